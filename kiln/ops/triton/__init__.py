"""Triton versions of the torch reference ops in kiln/ops, one file per op, each with the reference's
interface. They are registered with `torch.library.triton_op`, so torch.compile traces through them
and CUDA graphs capture their launches. Kernels compute in fp32 and round once on the store.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, how the tests run them).
There `op` and `launch` keep them working under torch.compile too: each op is an opaque custom op that
Inductor calls as it is, and its fake (shapes only) is the same body with every launch skipped."""

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.library import triton_op, wrap_triton

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def op(name: str, mutates_args: Iterable[str] = ()) -> Callable[[Callable], Any]:
    """`torch.library.triton_op`; under the interpreter, a custom op that torch.compile does not enter
    (the interpreter can't run on the fake tensors that tracing into a triton_op passes its kernels)."""
    if not INTERPRET:
        return triton_op(name, mutates_args=tuple(mutates_args))

    def register(fn: Callable) -> Any:
        custom = torch.library.custom_op(name, fn, mutates_args=tuple(mutates_args))
        custom.register_fake(fn)
        return custom

    return register


class _Interpreted:
    """An interpreted kernel whose launches on fake tensors (an op's fake, while torch.compile traces)
    run nothing."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __getitem__(self, grid: tuple) -> Callable[..., None]:
        def run(*args: Any, **kwargs: Any) -> None:
            if not any(isinstance(a, FakeTensor) for a in args):
                self.kernel[grid](*args, **kwargs)

        return run


def launch(kernel: Any) -> Any:
    """`torch.library.wrap_triton(kernel)`, indexed by the grid and called like the kernel."""
    return _Interpreted(kernel) if INTERPRET else wrap_triton(kernel)
