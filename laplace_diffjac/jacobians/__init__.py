"""The Jacobian engine: per-sample parameter Jacobians without side effects.

Everything here works on a plain ``torch.nn.Module`` and never imports laplace-
torch. One forward pass records the input and output of each module that owns a
parameter (``_layer_calls``; ``_forward`` runs it again where the model writes into
them in place, ``_in_place``, or broadcasts a module's output over the batch); one
batched ``torch.autograd.grad`` sends all output signals back to those outputs
(``_engine``); per-module rules (``_derivatives``, and ``_rules_local`` for modules
without one of their own) turn them into factors that are written into one ``(B, C,
P)`` tensor by a custom autograd function (``_assembly``). The curvature (GGN
diagonal, Kronecker factors, the empirical Fisher's diagonal) is the same forward
with its backward seeded with square roots of the loss Hessian, a chunk of those
rows at a time, each chunk's sums added and its signals freed (``_curvature``,
``_loss_seeds``, ``_kronecker``, ``_position_diagonal``); ``_model_guard`` undoes
every attribute, hook and ``.grad`` a call leaves behind, ``_last_layer`` gives
closed-form last-layer Jacobians and ``_inputs`` checks what comes in.
"""

from ._engine import parameter_jacobians, per_sample_gradients
from ._last_layer import last_layer_jacobians
from ._model_guard import preserved_state

__all__ = [
    "last_layer_jacobians",
    "parameter_jacobians",
    "per_sample_gradients",
    "preserved_state",
]
