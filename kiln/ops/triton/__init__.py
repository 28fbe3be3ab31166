"""Triton versions of the torch reference ops in kiln/ops, one file per op, each with the reference's
interface. They are registered with `torch.library.triton_op`, so torch.compile traces through them
and CUDA graphs capture their launches. Kernels compute in fp32 and round once on the store."""
