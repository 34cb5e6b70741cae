#!/usr/bin/env python3
"""Draw a detector's predictions (boxes, labels, scores, masks) on images and save PNGs.

    python tools/demo.py --config-file CFG MODEL.WEIGHT out/model_final.pth --images a.jpg b.png --out demo/
    python tools/demo.py --config-file configs/shapes_mask_rcnn_R_18_FPN.yaml --shapes 4 --out demo/

--shapes N draws N images of the shapes validation split instead of files. Without MODEL.WEIGHT
the last checkpoint of OUTPUT_DIR is used.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-file", default="", metavar="FILE")
    p.add_argument("--images", nargs="*", default=[], help="image files")
    p.add_argument("--shapes", type=int, default=0, help="draw this many shapes_val images")
    p.add_argument("--out", default="demo", help="output folder")
    p.add_argument("--score-thresh", type=float, default=0.5)
    p.add_argument("opts", nargs="*", help="KEY VALUE config overrides")
    args = p.parse_intermixed_args(argv)

    import numpy as np
    import torch
    from PIL import Image

    from detops.data import build_dataset
    from detops.data.shapes import CLASSES
    from detops.engine.checkpoint import Checkpointer
    from detops.engine.launch import ConfigError, _build_model, setup_cfg, setup_logger
    from detops.engine.visualize import draw_detections
    try:
        cfg = setup_cfg(args.config_file, args.opts)
    except ConfigError as e:
        p.error(str(e))
    setup_logger()
    model = _build_model(cfg)
    ck = Checkpointer(model, save_dir=cfg.OUTPUT_DIR)
    path = cfg.MODEL.WEIGHT or ck.last_checkpoint()
    if not path:
        p.error(f"no weights: set MODEL.WEIGHT or train into OUTPUT_DIR ({cfg.OUTPUT_DIR!r})")
    ck.load(path, model_only=True)
    model.eval()
    items = []
    for f in args.images:
        with Image.open(f) as im:
            arr = np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
        items.append((os.path.splitext(os.path.basename(f))[0], torch.from_numpy(arr).permute(2, 0, 1).float() / 255))
    if args.shapes:
        ds = build_dataset(cfg, "shapes_val", False)
        items += [(f"shapes_val_{i:03d}", ds[i][0]) for i in range(min(args.shapes, len(ds)))]
    if not items:
        p.error("nothing to draw: give --images FILES or --shapes N")
    with torch.no_grad():
        for name, img in items:
            pred = model([img.to(cfg.MODEL.DEVICE)])[0]
            out = draw_detections(img, pred, CLASSES, os.path.join(args.out, f"{name}.png"), args.score_thresh)
            print(f"{out}: {int((pred['scores'] >= args.score_thresh).sum())} detection(s)")


if __name__ == "__main__":
    main()
