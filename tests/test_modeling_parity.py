"""detops' GeneralizedRCNN with torchvision's weights returns torchvision's detections.

The torchvision models are randomly initialised (nothing is downloaded); their heads are nudged
so that the RPN and the box classifier produce confident, varied detections and the mask
logits are not flat. Both models run at the same, reduced input size to keep CPU time low.
"""

import pytest
import torch
import torchvision

from detops.modeling import from_torchvision, from_torchvision_state_dict, torchvision_key_to_detops
from detops.testing import nudge_detector

from tests.conftest import DEVICES

MIN_SIZE, MAX_SIZE = 256, 352


def _nudge(model):
    """A random torchvision detector with detections of several classes."""
    nudge_detector(model)
    model.roi_heads.detections_per_img = 30  # fewer masks to paste: CPU time
    return model


@pytest.fixture(scope="module")
def tv_mask_rcnn():
    torch.manual_seed(0)
    model = torchvision.models.detection.maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, min_size=MIN_SIZE, max_size=MAX_SIZE
    )
    return _nudge(model).eval()


def _images(device):
    g = torch.Generator().manual_seed(2)
    imgs = [torch.rand(3, 240, 320, generator=g), torch.rand(3, 200, 300, generator=g)]
    # some structure, so that features vary over the image
    imgs[0][:, 60:140, 80:220] *= 0.3
    imgs[1][:, 20:120, 150:280] += 0.5
    return [im.clamp(0, 1).to(device) for im in imgs]


def _canonical(out):
    """Detections sorted by score, ties by box: the order of equal scores is arbitrary
    (torchvision sorts them with an unstable sort)."""
    order = list(range(len(out["scores"])))
    key = [(-s, *bx) for s, bx in zip(out["scores"].tolist(), out["boxes"].tolist())]
    order.sort(key=lambda i: key[i])
    idx = torch.tensor(order, dtype=torch.int64, device=out["scores"].device)
    return {k: v[idx] for k, v in out.items()}


def _assert_same(tv_out, dt_out, masks):
    total = 0
    for a, b in zip(tv_out, dt_out):
        a, b = _canonical(a), _canonical(b)
        assert len(a["boxes"]) == len(b["boxes"])
        total += len(a["boxes"])
        assert torch.equal(a["labels"], b["labels"])
        torch.testing.assert_close(b["boxes"], a["boxes"], rtol=1e-3, atol=1e-3)
        torch.testing.assert_close(b["scores"], a["scores"], rtol=0, atol=1e-4)
        if masks:
            assert b["masks"].shape == a["masks"].shape
            ma, mb = a["masks"] > 0.5, b["masks"] > 0.5
            inter = (ma & mb).flatten(1).sum(1).float()
            union = (ma | mb).flatten(1).sum(1).float()
            iou = torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))
            if b["masks"].device.type == "cpu":
                assert (iou > 0.99).all(), iou.min()
            else:
                # On CUDA the two libraries' kernels contract multiply-adds differently, so boxes
                # differ by ~1e-4 relative (inside the 1e-3 allowed above); pasting a mask into a
                # box shifted by ~0.1 px flips a perimeter of pixels, which costs a small mask
                # about 1% of IoU. Every mask must stay above 0.98, and the average above 0.995.
                assert (iou > 0.98).all() and iou.mean() > 0.995, (iou.min(), iou.mean())
    assert total > 0, "the nudged model produced no detections: the comparison would be empty"
    assert len({int(l) for o in tv_out for l in o["labels"]}) > 1


@pytest.mark.parametrize("device", DEVICES)
def test_mask_rcnn_matches_torchvision(tv_mask_rcnn, device):
    tv = tv_mask_rcnn.to(device)
    model = from_torchvision(tv).eval()
    assert model.cfg.INPUT.MIN_SIZE_TEST == MIN_SIZE and model.cfg.MODEL.MASK_ON
    imgs = _images(device)
    with torch.no_grad():
        expected = tv(imgs)
        got = model(imgs)
    tv_mask_rcnn.to("cpu")
    assert any(m["masks"].gt(0.5).any() for m in got)
    _assert_same(expected, got, masks=True)


@pytest.mark.parametrize("device", DEVICES)
def test_faster_rcnn_from_state_dict_matches_torchvision(tv_mask_rcnn, device, tmp_path):
    state = {k: v for k, v in tv_mask_rcnn.state_dict().items() if "mask" not in k}
    tv = torchvision.models.detection.fasterrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, min_size=MIN_SIZE, max_size=MAX_SIZE
    )
    tv.load_state_dict(state)
    tv = tv.eval().to(device)
    path = tmp_path / "faster.pth"
    torch.save(state, path)
    tv.roi_heads.detections_per_img = 30
    model = from_torchvision_state_dict(str(path), mask=False)
    model.transform.min_size_test, model.transform.max_size_test = MIN_SIZE, MAX_SIZE
    model.roi_heads.box.post_processor.detections_per_img = 30
    model = model.to(device)
    assert not model.cfg.MODEL.MASK_ON
    imgs = _images(device)
    with torch.no_grad():
        expected = tv(imgs)
        got = model(imgs)
    assert "masks" not in got[0]
    _assert_same(expected, got, masks=False)


def test_key_mapping_accepts_old_torchvision_layout():
    assert torchvision_key_to_detops("backbone.fpn.inner_blocks.2.weight") == "backbone.fpn.inner_blocks.2.weight"
    assert torchvision_key_to_detops("backbone.fpn.inner_blocks.2.0.weight") == "backbone.fpn.inner_blocks.2.weight"
    assert torchvision_key_to_detops("rpn.head.conv.weight") == "rpn.head.conv.weight"
    assert torchvision_key_to_detops("rpn.head.conv.0.0.bias") == "rpn.head.conv.bias"
    assert (torchvision_key_to_detops("roi_heads.mask_head.mask_fcn3.weight")
            == "roi_heads.mask.feature_extractor.mask_fcn3.weight")
    assert (torchvision_key_to_detops("roi_heads.mask_head.2.0.weight")
            == "roi_heads.mask.feature_extractor.mask_fcn3.weight")
    assert torchvision_key_to_detops("backbone.body.bn1.num_batches_tracked") is None
    with pytest.raises(KeyError, match="no detops counterpart"):
        torchvision_key_to_detops("roi_heads.keypoint_head.0.weight")


@pytest.mark.slow
@pytest.mark.parametrize("device", DEVICES)
def test_mask_rcnn_matches_torchvision_default_size(device):
    torch.manual_seed(0)
    tv = _nudge(torchvision.models.detection.maskrcnn_resnet50_fpn(weights=None, weights_backbone=None)).eval().to(device)
    model = from_torchvision(tv).eval()
    assert model.cfg.INPUT.MIN_SIZE_TEST == 800 and model.cfg.INPUT.MAX_SIZE_TEST == 1333
    imgs = _images(device)
    with torch.no_grad():
        _assert_same(tv(imgs), model(imgs), masks=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("memory_format", [
    "contiguous",
    "channels_last",
])
def test_memory_format_keeps_detections(tv_mask_rcnn, device, memory_format):
    """MODEL.MEMORY_FORMAT changes the layout of the convolutions, not the detections. (On CUDA
    with TF32 convolutions the NHWC and NCHW kernels round differently, by more than the
    tolerances here, so TF32 is off for this comparison.)"""
    if device == "cuda" and memory_format == "channels_last":
        pytest.xfail("on CUDA, channels_last scores differ from torchvision's by more than 1e-4 "
                     "even with cuDNN TF32 off; not yet explained, so the layout is opt-in")
    tv = tv_mask_rcnn.to(device)
    model = from_torchvision(tv).eval()
    model.memory_format = memory_format
    imgs = _images(device)
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        _memory_format_check(tv, model, imgs, memory_format, tv_mask_rcnn)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32


def _memory_format_check(tv, model, imgs, memory_format, tv_mask_rcnn):
    with torch.no_grad():
        expected = tv(imgs)
        got = model(imgs)
        fmt = torch.channels_last if memory_format == "channels_last" else torch.contiguous_format
        conv = model.backbone.body.layer2[0].conv1.weight
        assert conv.is_contiguous(memory_format=fmt)
        x = model.transform(imgs)[0].tensors.contiguous(memory_format=fmt)
        feats = model.backbone(x)
        assert all(f.is_contiguous(memory_format=fmt) for f in feats.values())
    tv_mask_rcnn.to("cpu")
    # Masks are compared for the contiguous layout. channels_last convolutions (oneDNN on CPU,
    # cuDNN NHWC on CUDA) round differently, which can flip pasted pixels of a mask whose
    # logits sit near 0.5, so there only boxes, labels and scores are held to torchvision's.
    exact_masks = memory_format == "contiguous"
    _assert_same(expected, got, masks=exact_masks)


def test_channels_last_training_step_matches_contiguous(tv_mask_rcnn):
    """One training forward in channels_last gives the contiguous layout's losses, and the
    parameters keep their identity when their layout changes."""
    torch.manual_seed(0)
    model = from_torchvision(tv_mask_rcnn).train()
    imgs = _images("cpu")
    targets = [
        {"boxes": torch.tensor([[20.0, 30.0, 120.0, 150.0], [150.0, 40.0, 300.0, 190.0]]),
         "labels": torch.tensor([3, 5]), "masks": torch.zeros(2, 240, 320, dtype=torch.uint8)},
        {"boxes": torch.tensor([[10.0, 10.0, 200.0, 180.0]]), "labels": torch.tensor([1]),
         "masks": torch.ones(1, 200, 300, dtype=torch.uint8)},
    ]
    targets[0]["masks"][0, 40:140, 30:110] = 1
    params = list(model.parameters())
    losses = {}
    for fmt in ("contiguous", "channels_last"):
        model.memory_format = fmt
        torch.manual_seed(1)  # the same sampled anchors and RoIs
        losses[fmt] = model(imgs, targets)
    assert all(a is b for a, b in zip(params, model.parameters()))
    assert model.backbone.body.layer3[0].conv2.weight.is_contiguous(memory_format=torch.channels_last)
    for k, v in losses["contiguous"].items():
        torch.testing.assert_close(losses["channels_last"][k], v, rtol=1e-4, atol=1e-5)
    sum(losses["channels_last"].values()).backward()
    grad = model.backbone.body.layer3[0].conv2.weight.grad
    assert grad is not None and torch.isfinite(grad).all()


def test_memory_format_is_validated():
    from detops.modeling import torchvision_cfg, build_detection_model

    cfg = torchvision_cfg(mask=False)
    cfg.MODEL.MEMORY_FORMAT = "nhwc"
    with pytest.raises(ValueError, match="MODEL.MEMORY_FORMAT"):
        build_detection_model(cfg)
