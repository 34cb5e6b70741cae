"""Building from every YAML config, and training the small R-18 detector on CPU."""
import glob
import os

import pytest
import torch

from detops.config import get_cfg
from detops.modeling import build_detection_model
from detops.structures import BoxList

from tests.conftest import DEVICES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))


def _tiny_cfg(mask=True):
    cfg = get_cfg()
    cfg.merge_from_file(os.path.join(ROOT, "configs", "shapes_mask_rcnn_R_18_FPN.yaml"))
    cfg.merge_from_list([
        "MODEL.MASK_ON", mask,
        "MODEL.FPN.OUT_CHANNELS", 32,
        "MODEL.ROI_BOX_HEAD.MLP_HEAD_DIM", 64,
        "MODEL.ROI_MASK_HEAD.CONV_LAYERS", (32, 32),
        "MODEL.RPN.PRE_NMS_TOP_N_TRAIN", 200,
        "MODEL.RPN.FPN_POST_NMS_TOP_N_TRAIN", 100,
        "MODEL.ROI_HEADS.BATCH_SIZE_PER_IMAGE", 64,
        "INPUT.MIN_SIZE_TRAIN", (64,),
        "INPUT.MAX_SIZE_TRAIN", 96,
        "INPUT.MIN_SIZE_TEST", 64,
        "INPUT.MAX_SIZE_TEST", 96,
    ])
    return cfg


def _target(boxes, labels, h, w):
    masks = torch.zeros(len(boxes), h, w, dtype=torch.uint8)
    for i, (x1, y1, x2, y2) in enumerate(boxes):
        masks[i, int(y1):int(y2), int(x1):int(x2)] = 1
    return {"boxes": torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4),
            "labels": torch.tensor(labels, dtype=torch.int64), "masks": masks}


def _batch(device="cpu"):
    g = torch.Generator().manual_seed(0)
    imgs = [torch.rand(3, 64, 80, generator=g) * 0.2, torch.rand(3, 60, 72, generator=g) * 0.2]
    imgs[0][:, 8:40, 10:30] += 0.7
    imgs[0][:, 30:60, 45:75] += 0.5
    imgs[1][:, 5:35, 5:35] += 0.6
    targets = [_target([[10, 8, 30, 40], [45, 30, 75, 60]], [1, 2], 64, 80), _target([[5, 5, 35, 35]], [3], 60, 72)]
    return [i.to(device) for i in imgs], [{k: v.to(device) for k, v in t.items()} for t in targets]


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_build_from_each_config(path):
    cfg = get_cfg()
    cfg.merge_from_file(path)
    cfg.MODEL.DEVICE = "cpu"  # GPU configs are built here too
    model = build_detection_model(cfg)
    assert hasattr(model.roi_heads, "mask") == cfg.MODEL.MASK_ON
    if "shapes" in path:
        assert model.roi_heads.box.predictor.cls_score.out_features == 4
        model.eval()
        with torch.no_grad():
            out = model([torch.rand(3, 50, 70)])
        assert out[0]["boxes"].shape[1] == 4 and out[0]["scores"].shape == out[0]["labels"].shape
        if cfg.MODEL.MASK_ON:
            assert out[0]["masks"].shape[1:] == (1, 50, 70)


def test_unknown_backbone_name_is_reported():
    cfg = get_cfg()
    cfg.MODEL.BACKBONE.CONV_BODY = "R-77-FPN"
    with pytest.raises(KeyError, match=r"BACKBONES: unknown name 'R-77-FPN'; registered names are: .*R-50-FPN"):
        build_detection_model(cfg)


def test_training_step_changes_weights_and_loss_falls():
    torch.manual_seed(0)
    model = build_detection_model(_tiny_cfg()).train()
    imgs, targets = _batch()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    history = []
    for it in range(20):
        losses = model(imgs, targets)
        assert set(losses) == {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg", "loss_mask"}
        loss = sum(losses.values())
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
        history.append(loss.item())
        if it == 0:
            changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
            for name in ("rpn.head.cls_logits.weight", "roi_heads.box.predictor.cls_score.weight",
                         "roi_heads.mask.predictor.mask_fcn_logits.weight", "backbone.fpn.layer_blocks.0.weight"):
                assert name in changed
    assert sum(history[-3:]) / 3 < 0.6 * history[0], history


def test_empty_targets_train():
    torch.manual_seed(0)
    model = build_detection_model(_tiny_cfg()).train()
    imgs, targets = _batch()
    targets[1] = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
                  "masks": torch.zeros(0, 60, 72, dtype=torch.uint8)}
    losses = model(imgs, targets)
    sum(losses.values()).backward()
    # both images without objects
    targets[0] = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64),
                  "masks": torch.zeros(0, 64, 80, dtype=torch.uint8)}
    losses = model(imgs, targets)
    assert all(torch.isfinite(v) for v in losses.values())
    assert losses["loss_box_reg"] == 0 and losses["loss_mask"] == 0
    sum(losses.values()).backward()


def test_degenerate_target_box_is_rejected():
    model = build_detection_model(_tiny_cfg(mask=False)).train()
    imgs, targets = _batch()
    targets[1]["boxes"] = torch.tensor([[5.0, 5.0, 35.0, 35.0], [20.0, 10.0, 20.0, 30.0]])
    targets[1]["labels"] = torch.tensor([3, 1])
    with pytest.raises(ValueError, match=r"target 1 .*degenerate box at index 1: \[20.0, 10.0, 20.0, 30.0\]"):
        model(imgs, targets)


def test_boxlist_targets_accepted():
    torch.manual_seed(0)
    model = build_detection_model(_tiny_cfg(mask=False)).train()
    imgs, targets = _batch()
    boxlists = []
    for img, t in zip(imgs, targets):
        bl = BoxList(t["boxes"], (img.shape[2], img.shape[1]))
        bl.add_field("labels", t["labels"])
        boxlists.append(bl)
    losses = model(imgs, boxlists)
    assert "loss_mask" not in losses and torch.isfinite(sum(losses.values()))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_cuda_train_and_eval(dtype):
    torch.manual_seed(0)
    model = build_detection_model(_tiny_cfg()).to("cuda").train()
    imgs, targets = _batch("cuda")
    with torch.autocast("cuda", dtype=dtype):
        losses = model(imgs, targets)
    loss = sum(losses.values())
    assert torch.isfinite(loss)
    loss.backward()
    model.eval()
    with torch.no_grad(), torch.autocast("cuda", dtype=dtype):
        out = model(imgs)
    assert out[0]["boxes"].device.type == "cuda"


@pytest.mark.parametrize("device", DEVICES)
def test_eval_output_format(device):
    model = build_detection_model(_tiny_cfg()).to(device).eval()
    imgs, _ = _batch(device)
    with torch.no_grad():
        out = model(imgs)
    assert len(out) == 2
    for o, img in zip(out, imgs):
        assert set(o) == {"boxes", "labels", "scores", "masks"}
        assert o["masks"].shape[1:] == (1,) + tuple(img.shape[1:])
        assert o["labels"].dtype == torch.int64


@pytest.mark.cuda
def test_cuda_training_rpn_and_heads_make_no_host_sync(monkeypatch):
    # From the backbone's features to the gradients: proposals (nms_padded), sampling, pooling,
    # the box head and the losses run in fixed shapes, so the host does not wait for the GPU.
    # The one wait is the mask head's, for the positive counts (an event recorded right after
    # sampling; the sync debug mode does not see events, so the waits are counted here).
    from detops.modeling.utils import PendingCounts

    waits = []
    get = PendingCounts.get
    monkeypatch.setattr(PendingCounts, "get", lambda self: waits.append(1) or get(self))
    torch.manual_seed(0)
    model = build_detection_model(_tiny_cfg()).to("cuda").train()
    imgs, targets = _batch("cuda")
    sum(model(imgs, targets).values()).backward()  # first call: caches and kernel attributes
    image_list, boxlists = model.transform(imgs, targets)
    features = model.backbone(image_list.tensors)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        proposals, losses = model.rpn(image_list, features, boxlists)
        _, head_losses = model.roi_heads(features, proposals, image_list.image_sizes, boxlists)
        losses.update(head_losses)
        sum(losses.values()).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert set(losses) == {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg", "loss_mask"}
    assert all(torch.isfinite(v) for v in losses.values())
    assert len(waits) == 2  # one in the warm-up step, one in the step under test
