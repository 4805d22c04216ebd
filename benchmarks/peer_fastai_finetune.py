"""fastai's own fine-tuning, as a fastai user runs it, for benchmarks/finetune_peers.py: a folder
with train/ and val/, ``vision_learner(dls, ARCH, pretrained=False)`` (timm's ARCH as fastai builds
it: timm's body, fastai's head), the given weights loaded into the body, and ``fine_tune`` with
fastai's defaults: one epoch with the body frozen, then the rest with it unfrozen, so that the run
trains ``--epochs`` epochs in all. ``--lr-find``: the base LR is ``lr_find``'s suggestion instead of
fastai's default. After each epoch one JSON line gives the accuracy on val/.

Runs under an interpreter with fastai installed (not speedrun's): ``PYTHON peer_fastai_finetune.py
--data DIR --arch resnet18 --weights FILE --epochs 5``.
"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--arch", required=True, help="a timm architecture name")
    ap.add_argument("--weights", required=True, help="a state dict of timm's ARCH (.pth, .pt or .safetensors)")
    ap.add_argument("--epochs", type=int, required=True, help="epochs in all (the frozen one included)")
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--bs", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--lr-find", action="store_true")
    args = ap.parse_args(argv)
    if args.epochs < 2:
        ap.error("--epochs: fine_tune trains one frozen epoch and at least one more")

    import torch
    from fastai.callback.core import Callback
    from fastai.metrics import accuracy
    from fastai.torch_core import set_seed
    from fastai.vision.all import ImageDataLoaders, Resize, vision_learner

    set_seed(args.seed, reproducible=True)
    dls = ImageDataLoaders.from_folder(args.data, train="train", valid="val", item_tfms=Resize(args.size),
                                       bs=args.bs, num_workers=args.workers, device=torch.device("cpu"))
    learn = vision_learner(dls, args.arch, pretrained=False, metrics=accuracy)
    if args.weights.endswith(".safetensors"):
        from safetensors.torch import load_file
        state = load_file(args.weights)
    else:
        state = torch.load(args.weights, map_location="cpu", weights_only=True)
    body = learn.model[0].model                     # fastai's TimmBody holds timm's network, classifier removed
    result = body.load_state_dict(state, strict=False)
    if result.missing_keys:
        print(f"peer_fastai_finetune.py: {args.weights} lacks {len(result.missing_keys)} tensors of {args.arch}'s body, "
              f"e.g. {result.missing_keys[0]}", file=sys.stderr)
        return 2
    print(json.dumps({"loaded": len(state) - len(result.unexpected_keys), "not_loaded": result.unexpected_keys}),
          flush=True)

    class Report(Callback):
        order = 90                                  # after the recorder has the epoch's metrics
        done = 0

        def after_epoch(self):
            Report.done += 1
            print(json.dumps({"epoch": Report.done, "valid_accuracy": float(self.recorder.values[-1][-1])}),
                  flush=True)

    base_lr = 2e-3                                  # fine_tune's default
    if args.lr_find:
        base_lr = float(learn.lr_find(show_plot=False).valley)
        print(json.dumps({"lr_find": base_lr}), flush=True)
    learn.fine_tune(args.epochs - 1, base_lr=base_lr, cbs=[Report()])
    return 0


if __name__ == "__main__":
    sys.exit(main())
