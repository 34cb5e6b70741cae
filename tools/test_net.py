#!/usr/bin/env python3
"""Evaluate a checkpoint with COCO bbox / segm AP on DATASETS.TEST.

    python tools/test_net.py --config-file CFG [MODEL.WEIGHT path/to/model_final.pth] [KEY VALUE ...]

Without MODEL.WEIGHT the last checkpoint of OUTPUT_DIR is used. Works under torchrun too.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-file", default="", metavar="FILE")
    p.add_argument("--no-pictures", action="store_true", help="do not draw predictions")
    p.add_argument("opts", nargs="*", help="KEY VALUE config overrides")
    args = p.parse_intermixed_args(argv)

    from detops.engine.launch import ConfigError, init_from_env, setup_cfg, setup_logger, test
    try:
        cfg = setup_cfg(args.config_file, args.opts)
    except ConfigError as e:
        p.error(str(e))
    init_from_env(cfg)
    setup_logger(cfg.OUTPUT_DIR, "log_test.txt")
    from detops.engine.comm import shutdown_distributed
    try:
        test(cfg, save_pictures=not args.no_pictures)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
