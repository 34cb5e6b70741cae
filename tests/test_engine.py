"""Config overrides, LR schedule, checkpoints and exact resume, the COCO-format round trip,
checkpoint/architecture mismatch and the distributed (gloo, 2 CPU processes) path."""
import json
import os
import socket

import pytest
import torch

from detops.engine import Checkpointer, WarmupMultiStepLR, load_model_state
from detops.engine.launch import ConfigError, _build_model, setup_cfg, setup_logger, train

from tests.test_data import write_coco

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES_CFG = os.path.join(ROOT, "configs", "shapes_mask_rcnn_R_18_FPN.yaml")

TINY = [
    "MODEL.FPN.OUT_CHANNELS", 32, "MODEL.ROI_BOX_HEAD.MLP_HEAD_DIM", 64, "MODEL.ROI_MASK_HEAD.CONV_LAYERS", (16,),
    "MODEL.RPN.PRE_NMS_TOP_N_TRAIN", 100, "MODEL.RPN.FPN_POST_NMS_TOP_N_TRAIN", 50,
    "MODEL.RPN.PRE_NMS_TOP_N_TEST", 100, "MODEL.RPN.FPN_POST_NMS_TOP_N_TEST", 50,
    "MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", 32, "MODEL.ROI_HEADS.SCORE_THRESH", 0.0,
    "INPUT.MIN_SIZE_TRAIN", (64,), "INPUT.MAX_SIZE_TRAIN", 64, "INPUT.MIN_SIZE_TEST", 64, "INPUT.MAX_SIZE_TEST", 64,
    "DATASETS.SHAPES.IMAGE_SIZE", 64, "DATASETS.SHAPES.MIN_OBJ_SIZE", 10, "DATASETS.SHAPES.MAX_OBJ_SIZE", 32,
    "DATASETS.SHAPES.NUM_TRAIN", 16, "DATASETS.SHAPES.NUM_VAL", 4,
    "SOLVER.IMS_PER_BATCH", 2, "SOLVER.WARMUP_ITERS", 2, "SOLVER.LOG_PERIOD", 1, "TEST.IMS_PER_BATCH", 2,
    "TEST.VIS_IMAGES", 1, "DATALOADER.NUM_WORKERS", 0,
]


def tiny_cfg(output_dir, *opts):
    return setup_cfg(SHAPES_CFG, TINY + ["OUTPUT_DIR", str(output_dir)] + list(opts))


# ---------------------------------------------------------------------------- config
def test_config_overrides_are_merged_after_the_file():
    cfg = setup_cfg(SHAPES_CFG, ["SOLVER.BASE_LR", "0.005", "SOLVER.STEPS", "(10, 20)", "MODEL.RESNETS.NORM", "BN"])
    assert cfg.SOLVER.BASE_LR == 0.005 and cfg.SOLVER.STEPS == (10, 20) and cfg.MODEL.RESNETS.NORM == "BN"
    assert cfg.MODEL.ROI_BOX_HEAD.NUM_CLASSES == 4  # from the file
    assert cfg.is_frozen()


@pytest.mark.parametrize("opts,match", [
    (["SOLVER.BASE_LRR", "0.1"], r"unknown config key 'SOLVER.BASE_LRR'"),
    (["NOPE.X", "1"], r"unknown config key 'NOPE.X'"),
    (["SOLVER.BASE_LR"], r"KEY VALUE pairs"),
    (["SOLVER.MAX_ITER", "'many'"], r"config key 'SOLVER.MAX_ITER': cannot set it"),
])
def test_bad_overrides_are_clear_errors(opts, match):
    with pytest.raises(ConfigError, match=match):
        setup_cfg(SHAPES_CFG, opts)


def test_train_net_rejects_an_unknown_key(capsys):
    from tools.train_net import main
    with pytest.raises(SystemExit):
        main(["--config-file", SHAPES_CFG, "SOLVER.NOT_A_KEY", "1"])
    assert "unknown config key 'SOLVER.NOT_A_KEY'" in capsys.readouterr().err


def test_warmup_multistep_lr():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    s = WarmupMultiStepLR(opt, steps=(4, 6), gamma=0.1, warmup_factor=0.5, warmup_iters=2)
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        s.step()
    assert lrs == pytest.approx([0.05, 0.075, 0.1, 0.1, 0.01, 0.01, 0.001, 0.001])


# ---------------------------------------------------------------------------- checkpoints
def test_resume_gives_the_same_next_iteration_loss(tmp_path):
    setup_logger()
    # uninterrupted: 3 iterations
    cfg = tiny_cfg(tmp_path / "full", "SOLVER.MAX_ITER", 3, "SOLVER.CHECKPOINT_PERIOD", 2)
    _, _ = train(cfg, evaluate_after=False)
    full = torch.load(tmp_path / "full" / "model_final.pth", weights_only=False)["loss_history"]
    # interrupted after 2 iterations (the loader stops there), then resumed by a new run
    cfg2 = tiny_cfg(tmp_path / "cut", "SOLVER.MAX_ITER", 3, "SOLVER.CHECKPOINT_PERIOD", 2)
    train(cfg2, evaluate_after=False, max_iter=2)
    assert (tmp_path / "cut" / "last_checkpoint").read_text() == "model_0000002.pth"
    train(cfg2, evaluate_after=False)
    resumed = torch.load(tmp_path / "cut" / "model_final.pth", weights_only=False)["loss_history"]
    assert [h["iter"] for h in resumed] == [1, 2, 3]
    for a, b in zip(full, resumed):
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["iter"], k)


def test_checkpoint_of_another_architecture_is_a_clear_error(tmp_path):
    a = _build_model(tiny_cfg(tmp_path))
    b = _build_model(tiny_cfg(tmp_path, "MODEL.MASK_ON", False, "MODEL.FPN.OUT_CHANNELS", 16))
    Checkpointer(b, save_dir=str(tmp_path)).save("other", 0)
    with pytest.raises(ValueError, match=r"another architecture.*missing keys: roi_heads\.mask.*shape mismatches"):
        Checkpointer(a, save_dir=str(tmp_path)).load(str(tmp_path / "other.pth"))
    with pytest.raises(ValueError, match="unexpected keys: extra.weight"):
        load_model_state(a, dict(a.state_dict(), **{"extra.weight": torch.zeros(1)}))


# ---------------------------------------------------------------------------- COCO round trip
def test_coco_format_round_trip_train_and_evaluate(tmp_path, capsys):
    img_dir, ann = write_coco(str(tmp_path / "data"), n_images=4)
    out = tmp_path / "out"
    cfg = tiny_cfg(out, "DATASETS.COCO_ROOTS", [["tiny_coco", img_dir, ann]], "DATASETS.TRAIN", ("tiny_coco",),
                   "DATASETS.TEST", ("tiny_coco",), "SOLVER.MAX_ITER", 2)
    setup_logger(cfg.OUTPUT_DIR)
    _, results = train(cfg)
    r = results["tiny_coco"]
    for task in ("bbox", "segm"):
        for m in ("AP", "AP50", "AP75"):
            assert isinstance(r[task][m], float) and r[task][m] == r[task][m]  # a number, not NaN
    assert "bbox AP50:" in capsys.readouterr().out
    dets = json.load(open(out / "inference" / "tiny_coco" / "detections_bbox.json"))
    assert dets and {d["category_id"] for d in dets} <= {10, 20, 30}
    assert {d["image_id"] for d in dets} <= {100, 101, 102, 103}
    assert (out / "loss_curve.png").exists() and (out / "log.txt").exists()
    assert (out / "visualization" / "tiny_coco" / "000.png").exists()
    # test_net on the trained weights
    from tools.test_net import main
    main(["--config-file", SHAPES_CFG, "--no-pictures"] + [str(x) for x in TINY] + [
        "OUTPUT_DIR", str(out), "DATASETS.COCO_ROOTS", f"[['tiny_coco', '{img_dir}', '{ann}']]",
        "DATASETS.TEST", "('tiny_coco',)", "MODEL.WEIGHT", str(out / "model_final.pth")])
    assert "bbox AP50:" in capsys.readouterr().out


# ---------------------------------------------------------------------------- distributed
def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    cfg = tiny_cfg(out_dir, "SOLVER.MAX_ITER", 2, "TEST.VIS_IMAGES", 0)
    from detops.engine.launch import init_from_env
    init_from_env(cfg)
    setup_logger(cfg.OUTPUT_DIR)
    try:
        _, results = train(cfg)
        if rank == 0:
            with open(os.path.join(out_dir, "results.json"), "w") as f:
                json.dump(results, f)
        else:
            assert results == {}
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_distributed_gloo_two_processes(tmp_path):
    torch.multiprocessing.spawn(_dist_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r = json.load(open(tmp_path / "results.json"))["shapes_val"]
    assert r["bbox"]["AP50"] == r["bbox"]["AP50"]
    ck = torch.load(tmp_path / "model_final.pth", weights_only=False)
    assert ck["iteration"] == 2 and len(ck["rng"]) == 2 and len(ck["loss_history"]) == 2
    assert (tmp_path / "log.txt").exists() and (tmp_path / "log_rank1.txt").exists()
