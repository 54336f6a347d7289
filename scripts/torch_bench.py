#!/usr/bin/env python3
"""PyTorch reference for `trainer bench`: the same training step (SGD momentum 0.9, weight decay 1e-4,
cross-entropy, synthetic data made on the GPU, autocast + GradScaler for fp16) timed the same way.

usage: torch_bench.py ARCH DTYPES BATCH_SIZES [--channels-last] [--steps N] [--warmup N]
  e.g. torch_bench.py resnet152 fp32,bf16,fp16 64,128,256 --channels-last
Prints one JSON object per configuration: {"arch","dtype","batch_size","img_per_s","step_ms","peak_gib",
"reserved_gib","device_gib","oom"}. Memory, three ways: peak_gib is the caching allocator's peak of live tensor
bytes (torch.cuda.max_memory_allocated), reserved_gib its peak reserve (max_memory_reserved), device_gib the
device memory the process holds after the timed steps beyond what it held before building the model (total - free
from cudaMemGetInfo: the reserve, which the allocator keeps, plus cuDNN/cuBLAS state), which is what `trainer
bench`'s peak_gib measures (NVML's used memory, its maximum over the run less the value after device selection).
"""
import argparse
import json
import time

import torch
import torchvision


def used_bytes():
    free, total = torch.cuda.mem_get_info()
    return total - free


def run(arch, dtype, bs, channels_last, warmup, steps):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    dev = torch.device("cuda")
    base = used_bytes()
    model = getattr(torchvision.models, arch)(num_classes=1000).to(dev)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=fmt)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(bs, 3, 224, 224, device=dev).to(memory_format=fmt)
    y = torch.randint(0, 1000, (bs,), device=dev)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_interval=2000, enabled=dtype == "fp16")
    # Plain FP32 (no TF32), as the Rust trainer's fp32 mode.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=low or torch.float32, enabled=low is not None):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    rec = dict(arch=arch, dtype=dtype, batch_size=bs, channels_last=channels_last, framework="pytorch")
    try:
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / steps
        gib = 2.0**30
        rec.update(img_per_s=bs / dt, step_ms=dt * 1e3, peak_gib=torch.cuda.max_memory_allocated() / gib,
                   reserved_gib=torch.cuda.max_memory_reserved() / gib, device_gib=(used_bytes() - base) / gib,
                   oom=False)
    except torch.OutOfMemoryError:
        rec.update(img_per_s=None, step_ms=None, peak_gib=None, reserved_gib=None, device_gib=None, oom=True)
    del model, opt
    return rec


def main():
    p = argparse.ArgumentParser()
    p.add_argument("arch")
    p.add_argument("dtypes")
    p.add_argument("batch_sizes")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    torch.backends.cudnn.benchmark = True
    for dt in a.dtypes.split(","):
        for bs in a.batch_sizes.split(","):
            print("TORCH_JSON " + json.dumps(run(a.arch, dt, int(bs), a.channels_last, a.warmup, a.steps)), flush=True)


if __name__ == "__main__":
    main()
