import pytest

from laplace_diffjac.laplace_integration._patching import AttributePatch, SharedPatches


class _Owner:
    value = "original"


class _Failing:
    def apply(self):
        raise RuntimeError("boom")

    def revert(self):  # pragma: no cover - never applied
        raise AssertionError("a change that failed to apply is not reverted")


def _patch():
    return AttributePatch(_Owner, "value", "patched")


def test_reference_counting():
    shared = SharedPatches(lambda: [_patch()])
    assert shared.acquire() and not shared.acquire()
    assert _Owner.value == "patched"
    assert not shared.release() and _Owner.value == "patched"
    assert shared.release() and _Owner.value == "original"
    assert not shared.release() and not shared.active
    assert "value" in vars(_Owner)


def test_max_users_makes_acquire_idempotent():
    shared = SharedPatches(lambda: [_patch()], max_users=1)
    assert shared.acquire() and not shared.acquire()
    assert shared.release() and _Owner.value == "original"


def test_failure_while_applying_reverts_what_was_applied():
    shared = SharedPatches(lambda: [_patch(), _Failing()])
    with pytest.raises(RuntimeError, match="boom"):
        shared.acquire()
    assert _Owner.value == "original" and not shared.active
    assert not shared.release()


def test_release_refuses_when_a_change_was_replaced_again():
    shared = SharedPatches(lambda: [_patch()])
    shared.acquire()
    _Owner.value = "someone else's"
    with pytest.raises(RuntimeError, match="patched again"):
        shared.release()
    assert shared.active and _Owner.value == "someone else's"
    _Owner.value = "patched"  # the other patch is undone
    assert shared.release() and _Owner.value == "original"
