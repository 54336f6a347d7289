"""cuDNN baseline for scripts/kernels-bench.sh: every distinct ResNet-152 convolution at batch N, bf16 (or fp16)
channels-last, forward / grad-input / grad-weight timed separately with cuDNN's autotuner on.

usage: python3 scripts/torch_conv_shapes.py [N] [bf16|fp16]   -> JSON lines on stdout, $OUT/torch_conv_shapes.json
"""
import json
import os
import sys

import torch
import torchvision


def distinct_convs():
    """(c_in, c_out, k, stride, pad, hw) -> count over one forward of torchvision's ResNet-152."""
    model = torchvision.models.resnet152()
    found = {}

    def hook(mod, inp, _out):
        key = (mod.in_channels, mod.out_channels, mod.kernel_size[0], mod.stride[0], mod.padding[0], inp[0].shape[2])
        found[key] = found.get(key, 0) + 1

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    with torch.no_grad():
        model(torch.zeros(1, 3, 224, 224))
    for h in handles:
        h.remove()
    return found


def mean_ms(fn, iters=20):
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "f16": torch.float16}[sys.argv[2] if len(sys.argv) > 2 else "bf16"]
    torch.backends.cudnn.benchmark = True
    dev = "cuda"
    rows = []
    for (ci, co, k, st, pd, hw), count in sorted(distinct_convs().items(), key=lambda kv: -kv[1]):
        cl = torch.channels_last
        x = torch.randn(n, ci, hw, hw, device=dev, dtype=dtype).to(memory_format=cl)
        w = torch.randn(co, ci, k, k, device=dev, dtype=dtype).to(memory_format=cl)
        y = torch.nn.functional.conv2d(x, w, None, st, pd)
        dy = torch.randn_like(y)
        flop = 2 * n * co * y.shape[2] * y.shape[3] * ci * k * k
        conv_bwd = torch.ops.aten.convolution_backward
        args = ([st, st], [pd, pd], [1, 1], False, [0, 0], 1)
        fwd = mean_ms(lambda: torch.nn.functional.conv2d(x, w, None, st, pd))
        dgrad = mean_ms(lambda: conv_bwd(dy, x, w, None, *args, [True, False, False]))
        wgrad = mean_ms(lambda: conv_bwd(dy, x, w, None, *args, [False, True, False]))
        row = dict(cin=ci, cout=co, k=k, stride=st, pad=pd, hw=hw, count=count, gflop=flop / 1e9,
                   fwd_ms=fwd, dgrad_ms=dgrad, wgrad_ms=wgrad)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = os.path.join(os.environ.get("OUT", "/tmp"), "torch_conv_shapes.json")
    with open(out, "w") as f:
        json.dump(dict(N=n, dtype=str(dtype), torch=torch.__version__, cudnn=torch.backends.cudnn.version(), rows=rows), f)


if __name__ == "__main__":
    main()
