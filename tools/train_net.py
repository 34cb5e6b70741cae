#!/usr/bin/env python3
"""Train a detector from a config, then evaluate it.

    python tools/train_net.py --config-file configs/shapes_mask_rcnn_R_18_FPN.yaml [KEY VALUE ...]
    torchrun --nproc_per_node 2 tools/train_net.py --config-file CFG MODEL.DEVICE cuda

Resumes from OUTPUT_DIR's last checkpoint when there is one (--no-resume starts over);
--resume PATH resumes from a given checkpoint file. Writes OUTPUT_DIR/log.txt, checkpoints,
loss_curve.png, inference/<dataset>/ (detections JSON, metrics) and visualization/<dataset>/.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config-file", default="", metavar="FILE")
    p.add_argument("--resume", nargs="?", const="", default=None, metavar="PATH",
                   help="resume from PATH (default: OUTPUT_DIR's last checkpoint, which is also what happens "
                        "without this flag)")
    p.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints in OUTPUT_DIR")
    p.add_argument("--skip-test", action="store_true", help="no final evaluation")
    p.add_argument("opts", nargs="*", help="KEY VALUE config overrides")
    args = p.parse_intermixed_args(argv)

    from detops.engine.launch import ConfigError, init_from_env, setup_cfg, setup_logger, train
    try:
        cfg = setup_cfg(args.config_file, args.opts)
    except ConfigError as e:
        p.error(str(e))
    init_from_env(cfg)
    log = setup_logger(cfg.OUTPUT_DIR)
    log.info("config file %s, overrides %s", args.config_file, args.opts)
    if args.resume:  # an explicit checkpoint file: point last_checkpoint at it
        from detops.engine.comm import is_main_process, synchronize
        if not os.path.exists(args.resume):
            p.error(f"--resume: checkpoint {args.resume!r} does not exist")
        if is_main_process():
            os.makedirs(cfg.OUTPUT_DIR, exist_ok=True)
            with open(os.path.join(cfg.OUTPUT_DIR, "last_checkpoint"), "w") as f:
                f.write(os.path.abspath(args.resume))
        synchronize()
    from detops.engine.comm import shutdown_distributed
    try:
        train(cfg, resume=not args.no_resume, evaluate_after=not args.skip_test)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    main()
