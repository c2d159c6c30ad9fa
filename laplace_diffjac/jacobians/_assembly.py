"""Write per-parameter Jacobian blocks straight into one ``(batch, V, P)`` tensor.

The per-module rules (:mod:`.derivatives`) do not materialise their blocks; they
return *factors*, and :func:`assemble` writes every block into its column range of a
single preallocated result inside one custom autograd function. Compared with
building each block and concatenating, this saves one full write and read of the
Jacobian in the forward pass and the strided copies of its gradient in the backward
pass, which on CPU is most of the cost beyond the unavoidable single write of J.

The backward pass of the function is written with ordinary differentiable
operations on the saved factors, so the result supports double backward
(``gradgradcheck``) like any other autograd graph.

Factor kinds, for ``V`` rows (outputs), ``B`` samples:

:class:`Product`
    ``J[b, v, o, k] = Σ_l g[b, v, o, l] · a[b, l, k]`` with signals ``g``
    ``(B, V, out, L)`` and inputs ``a`` ``(B, L, K)``: Linear (``L`` = extra
    positions, ``K`` = in features) and Conv2d (``L`` = output positions, ``K`` =
    unfolded patch size). With ``L == 1`` an outer product.
:class:`TransposedProduct`
    the same with the columns ordered ``(K, out)``: Hugging Face's ``Conv1D``.
:class:`Summed`
    ``J[b, v, o] = Σ_l g[v, b, o, l]``: biases.
:class:`Scattered`
    ``J[b, v, s, k] = Σ_l [index[b, l] = s] · g[v, b, l, k]`` with signals ``g``
    ``(V, B, L, K)`` and integer ``index`` ``(B, L)``: Embedding (``L`` =
    positions, ``K`` = embedding width). A scatter, not a one-hot product: its
    cost does not grow with the vocabulary beyond the write of the block.
:class:`Dense`
    A block computed elsewhere, ``(V, B, n)`` (BackPACK's ``param_mjp``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import torch


@dataclass(frozen=True)
class Product:
    """Factors of ``J[b, v, o, k] = Σ_l g[b, v, o, l] · a[b, l, k]``.

    Attributes
    ----------
    g : torch.Tensor
        ``(B, V, out, L)``: signals at the module output.
    a : torch.Tensor
        ``(B, L, K)``: module inputs (or unfolded patches).

    """

    g: torch.Tensor
    a: torch.Tensor
    n_tensors: ClassVar[int] = 2

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The autograd inputs, in the order ``write`` and ``backward`` take them."""
        return (self.g, self.a)

    #: Columns ordered ``(out, K)`` (a weight ``(out, in)``); ``True`` in
    #: :class:`TransposedProduct`, whose weight is stored ``(K, out)``.
    transposed: ClassVar[bool] = False

    @classmethod
    def block_view(cls, dst: torch.Tensor, n_out: int, width: int) -> torch.Tensor:
        """``dst`` ``(B, V, out·K)`` as ``(B, V, out, K)`` in the column order."""
        batch, n_rows = dst.shape[:2]
        if cls.transposed:
            return dst.view(batch, n_rows, width, n_out).transpose(2, 3)
        return dst.view(batch, n_rows, n_out, width)

    @classmethod
    def write(
        cls, dst: torch.Tensor, accumulate: bool, g: torch.Tensor, a: torch.Tensor
    ) -> None:
        """Write (or add) the block into ``dst`` ``(B, V, out·K)``, no autograd."""
        batch, n_rows, n_out, positions = g.shape
        view = cls.block_view(dst, n_out, a.shape[2])
        if positions == 1:
            outer = (g, a[:, None, :, :])
            if accumulate:
                view.addcmul_(*outer)
            elif cls.transposed:
                view.copy_(outer[0] * outer[1])
            else:
                torch.mul(*outer, out=view)
            return
        block = torch.bmm(g.reshape(batch, n_rows * n_out, positions), a)
        block = block.view(view.shape)
        if accumulate:
            view.add_(block)
        else:
            view.copy_(block)

    @classmethod
    def backward(
        cls, grad: torch.Tensor, g: torch.Tensor, a: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gradients with respect to ``g`` and ``a`` of ``<grad, J>``."""
        batch, n_rows, n_out, positions = g.shape
        view = cls.block_view(grad, n_out, a.shape[2])
        if positions == 1:
            a_col = a.transpose(1, 2).unsqueeze(1)  # (B, 1, K, 1)
            grad_g = torch.matmul(view, a_col)  # (B, V, out, 1)
            g_row = g.transpose(2, 3)  # (B, V, 1, out)
            grad_a = torch.matmul(g_row, view).sum(1)  # (B, 1, K)
            return grad_g, grad_a
        rows = view.reshape(batch, n_rows * n_out, a.shape[2])  # small copy
        grad_g = torch.bmm(rows, a.transpose(1, 2)).view(g.shape)
        # (K, L)-major: several times faster than (L, K) for few, long rows
        grad_a_t = torch.bmm(rows.transpose(1, 2), g.reshape(batch, -1, positions))
        return grad_g, grad_a_t.transpose(1, 2)


@dataclass(frozen=True)
class TransposedProduct(Product):
    """:class:`Product` of a weight stored ``(K, out)``: columns ordered ``(K, out)``.

    Hugging Face's ``Conv1D`` (GPT-2's Linear, ``x @ W + b`` with ``W`` ``(in,
    out)``). Grams and other contractions that do not depend on the column order
    treat it as a :class:`Product`.
    """

    transposed: ClassVar[bool] = True


@dataclass(frozen=True)
class Summed:
    """Factor of ``J[b, v, o] = Σ_l g[v, b, o, l]``.

    Attributes
    ----------
    g : torch.Tensor
        ``(V, B, out, L)``.

    """

    g: torch.Tensor
    n_tensors: ClassVar[int] = 1

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The autograd inputs, in the order ``write`` and ``backward`` take them."""
        return (self.g,)

    @staticmethod
    def write(dst: torch.Tensor, accumulate: bool, g: torch.Tensor) -> None:
        """Write (or add) the block into ``dst`` ``(B, V, out)``, no autograd."""
        block = (g[..., 0] if g.shape[3] == 1 else g.sum(3)).transpose(0, 1)
        if accumulate:
            dst.add_(block)
        else:
            dst.copy_(block)

    @staticmethod
    def backward(grad: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor]:
        """Gradient with respect to ``g`` of ``<grad, J>``."""
        return (grad.transpose(0, 1).unsqueeze(3).expand(g.shape),)


@dataclass(frozen=True)
class Scattered:
    """Factors of ``J[b, v, s, k] = Σ_l [index[b, l] = s] · g[v, b, l, k]``.

    Attributes
    ----------
    g : torch.Tensor
        ``(V, B, L, K)``: signals at the embedding output.
    index : torch.Tensor
        ``(B, L)``, integer: the rows looked up.

    """

    g: torch.Tensor
    index: torch.Tensor
    n_tensors: ClassVar[int] = 2

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The autograd inputs, in the order ``write`` and ``backward`` take them."""
        return (self.g, self.index)

    @staticmethod
    def write(
        dst: torch.Tensor, accumulate: bool, g: torch.Tensor, index: torch.Tensor
    ) -> None:
        """Write (or add) the block into ``dst`` ``(B, V, S·K)``, no autograd."""
        view = _rows_by_seed(dst, g.shape)
        if not accumulate:
            view.zero_()
        view.scatter_add_(2, _index_like(index, g.shape), g)

    @staticmethod
    def backward(
        grad: torch.Tensor, g: torch.Tensor, index: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        """Gradient with respect to ``g`` of ``<grad, J>`` (none for ``index``)."""
        view = _rows_by_seed(grad, g.shape)
        return torch.gather(view, 2, _index_like(index, g.shape)), None


def _rows_by_seed(block: torch.Tensor, g_shape: torch.Size) -> torch.Tensor:
    """A ``(B, V, S·K)`` block as the view ``(V, B, S, K)``."""
    n_rows, batch, _, width = g_shape
    return block.view(batch, n_rows, -1, width).transpose(0, 1)


def _index_like(index: torch.Tensor, g_shape: torch.Size) -> torch.Tensor:
    """``index`` ``(B, L)`` expanded to the signals' ``(V, B, L, K)``, no copy."""
    return index[None, :, :, None].expand(g_shape)


@dataclass(frozen=True)
class Dense:
    """A materialised block ``(V, B, n)``.

    Attributes
    ----------
    block : torch.Tensor
        ``(V, B, n)``.

    """

    block: torch.Tensor
    n_tensors: ClassVar[int] = 1

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The autograd inputs, in the order ``write`` and ``backward`` take them."""
        return (self.block,)

    @staticmethod
    def write(dst: torch.Tensor, accumulate: bool, block: torch.Tensor) -> None:
        """Write (or add) the block into ``dst`` ``(B, V, n)``, no autograd."""
        if accumulate:
            dst.add_(block.transpose(0, 1))
        else:
            dst.copy_(block.transpose(0, 1))

    @staticmethod
    def backward(grad: torch.Tensor, block: torch.Tensor) -> tuple[torch.Tensor]:
        """Gradient with respect to ``block`` of ``<grad, J>``."""
        return (grad.transpose(0, 1),)


Factors = Union[Product, TransposedProduct, Summed, Scattered, Dense]

#: One entry of the layout: factor kind, first column, number of columns,
#: whether the block adds to an earlier one (shared modules).
_Entry = tuple[
    Union[
        type[Product],
        type[TransposedProduct],
        type[Summed],
        type[Scattered],
        type[Dense],
    ],
    int,
    int,
    bool,
]


class _Assemble(torch.autograd.Function):
    """``(B, V, P)`` Jacobian from factors; inputs are the factors' tensors."""

    @staticmethod
    def forward(
        ctx: Any,
        layout: tuple[_Entry, ...],
        shape: tuple[int, int, int],
        uncovered: tuple[tuple[int, int], ...],
        like: tuple[torch.dtype, torch.device],
        *tensors: torch.Tensor,
    ) -> torch.Tensor:
        J = torch.empty(shape, dtype=like[0], device=like[1])
        for start, stop in uncovered:
            J[:, :, start:stop].zero_()
        for (kind, start, size, accumulate), args in _with_tensors(layout, tensors):
            kind.write(J[:, :, start : start + size], accumulate, *args)
        ctx.layout = layout
        ctx.save_for_backward(*tensors)
        return J

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grads: list[torch.Tensor | None] = [None, None, None, None]
        tensors = ctx.saved_tensors
        for (kind, start, size, _), args in _with_tensors(ctx.layout, tensors):
            grads.extend(kind.backward(grad[:, :, start : start + size], *args))
        return tuple(grads)


def _with_tensors(
    layout: Sequence[_Entry], tensors: Sequence[torch.Tensor]
) -> Iterator[tuple[_Entry, Sequence[torch.Tensor]]]:
    """Pair each layout entry with its slice of the flat tensor list."""
    i = 0
    for entry in layout:
        n = entry[0].n_tensors
        yield entry, tensors[i : i + n]
        i += n


def assemble(
    factors: dict[int, list[Factors]],
    params: Sequence[torch.Tensor],
    n_rows: int,
    batch: int,
    like: torch.Tensor,
) -> torch.Tensor:
    """Write the blocks of ``params`` into one Jacobian ``(batch, n_rows, P)``.

    Parameters
    ----------
    factors : dict
        ``id(param) -> [factors, ...]``, one entry per module call that uses the
        parameter (several for shared modules, which are summed).
    params : sequence of torch.Tensor
        Parameters in column order; those without factors get zero columns.
    n_rows : int
        Rows ``V`` per sample (outputs, or selected outputs).
    batch : int
        Samples ``B``.
    like : torch.Tensor
        Gives dtype and device of the result.

    Returns
    -------
    torch.Tensor
        ``(batch, n_rows, P)``, differentiable with respect to every factor.

    """
    layout: list[_Entry] = []
    tensors: list[torch.Tensor] = []
    uncovered: list[tuple[int, int]] = []
    start = 0
    for p in params:
        size = p.numel()
        entries = factors.get(id(p), [])
        if not entries:
            uncovered.append((start, start + size))
        for i, entry in enumerate(entries):
            layout.append((type(entry), start, size, i > 0))
            tensors.extend(entry.tensors())
        start += size
    shape = (batch, n_rows, start)
    if not tensors or n_rows == 0 or batch == 0:
        return like.new_zeros(shape)
    like_args = (like.dtype, like.device)
    return _Assemble.apply(tuple(layout), shape, tuple(uncovered), like_args, *tensors)
