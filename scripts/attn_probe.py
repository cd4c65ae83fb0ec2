"""Probe what the GPU machine's Triton offers for the attention kernels (tensor descriptors, warp
specialization) and print versions. Usage: python3 scripts/attn_probe.py"""
import torch
import triton
import triton.language as tl

print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())
print("tl.make_tensor_descriptor", hasattr(tl, "make_tensor_descriptor"))
try:
    from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    print("host TensorDescriptor: yes")
except Exception as e:
    print("host TensorDescriptor:", e)
import inspect
print("tl.range params:", list(inspect.signature(tl.range.__init__).parameters))
print("set_allocator", hasattr(triton, "set_allocator"))


@triton.jit
def _desc_copy(x_ptr, y_ptr, M, N, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    xd = tl.make_tensor_descriptor(x_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    yd = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BM, BN])
    acc = tl.zeros([BM, BN], tl.float32)
    for i in tl.range(0, 4, warp_specialize=False):
        acc += xd.load([pid * BM, 0]).to(tl.float32)
    yd.store([pid * BM, 0], acc.to(tl.bfloat16))


def alloc(size, alignment, stream):
    return torch.empty(size, device="cuda", dtype=torch.int8)


triton.set_allocator(alloc)
x = torch.randn(300, 64, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
_desc_copy[(triton.cdiv(300, 64),)](x, y, 300, 64, BM=64, BN=64)
print("device descriptor OK:", torch.allclose(y.float(), 4 * x.float(), atol=1e-2))
