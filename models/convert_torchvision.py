#!/usr/bin/env python3
"""Convert torchvision ResNet weights to safetensors with torchvision's state_dict keys (what `model.init_from` reads).

usage:
  python3 models/convert_torchvision.py resnet50 models/resnet50.safetensors         # torchvision's ImageNet weights
  python3 models/convert_torchvision.py path/to/checkpoint.pth models/mine.safetensors  # a saved state_dict / checkpoint

Needs torch, torchvision (first form) and safetensors. Running statistics and num_batches_tracked are kept.
"""
import sys


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    src, dst = sys.argv[1], sys.argv[2]
    import torch
    from safetensors.torch import save_file

    if src in ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152"):
        import torchvision

        state = getattr(torchvision.models, src)(weights="DEFAULT").state_dict()
    else:
        obj = torch.load(src, map_location="cpu", weights_only=True)
        # Accept a bare state_dict or a training checkpoint holding one.
        for key in ("state_dict", "model", "model_state_dict"):
            if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
                obj = obj[key]
                break
        if not isinstance(obj, dict):
            print(f"error: {src}: no state_dict found", file=sys.stderr)
            return 1
        # DataParallel / DDP checkpoints prefix every key with "module.".
        state = {k.removeprefix("module."): v for k, v in obj.items()}
    tensors = {k: v.detach().contiguous() for k, v in state.items() if isinstance(v, torch.Tensor)}
    save_file(tensors, dst)
    print(f"wrote {len(tensors)} tensors to {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
