"""MultiScaleRoIAlign and LevelMapper against torchvision's."""
import pytest
import torch
import torchvision
from torchvision.ops import poolers as tv_poolers

from detops.ops import MultiScaleRoIAlign
from detops.ops.poolers import LevelMapper
from detops.testing import random_rois
from tests.conftest import DEVICES


# CUDA kernels contract sample coordinates with fused multiply-adds: float32 rounding of
# coordinates in the hundreds moves bilinear weights by ~1e-5.
TOL = {"cpu": dict(rtol=1e-5, atol=1e-5), "cuda": dict(rtol=1e-4, atol=1e-4)}


def fpn_inputs(device, dtype=torch.float32, batch=2, channels=8, image=(256, 320), per_image=(40, 25), seed=0):
    g = torch.Generator().manual_seed(seed)
    h, w = image
    feats = {
        name: torch.randn(batch, channels, h // stride, w // stride, generator=g).to(device, dtype)
        for name, stride in [("p2", 4), ("p3", 8), ("p4", 16), ("p5", 32)]
    }
    boxes = []
    for i, k in enumerate(per_image):
        r = random_rois(k, 1, h, w, seed=seed + i)[:, 1:]
        # a spread of sizes, from a few pixels to most of the image, so every level is used
        scale = torch.logspace(-2.5, 0, k)[torch.randperm(k, generator=g)][:, None]
        c = (r[:, :2] + r[:, 2:]) / 2
        half = (r[:, 2:] - r[:, :2]) / 2 * scale * 4
        boxes.append(torch.cat([c - half, c + half], 1).to(device, dtype))
    return feats, boxes, [image] * batch


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("output_size,sampling_ratio", [(7, 2), ((14, 14), 2), ((7, 5), -1)])
def test_matches_torchvision(device, output_size, sampling_ratio):
    feats, boxes, shapes = fpn_inputs(device)
    names = ["p2", "p3", "p4", "p5"]
    ours = MultiScaleRoIAlign(names, output_size, sampling_ratio)(feats, boxes, shapes)
    theirs = torchvision.ops.MultiScaleRoIAlign(names, output_size, sampling_ratio)(
        {k: v.cpu() for k, v in feats.items()}, [b.cpu() for b in boxes], shapes
    )
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours.cpu(), theirs, **TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_single_level_and_subset(device):
    feats, boxes, shapes = fpn_inputs(device)
    for names in (["p3"], ["p3", "p4"]):
        ours = MultiScaleRoIAlign(names, 7, 2)(feats, boxes, shapes)
        theirs = torchvision.ops.MultiScaleRoIAlign(names, 7, 2)(
            {k: v.cpu() for k, v in feats.items()}, [b.cpu() for b in boxes], shapes
        )
        torch.testing.assert_close(ours.cpu(), theirs, **TOL[device])


@pytest.mark.parametrize("device", DEVICES)
def test_canonical_settings_and_gradients(device):
    feats, boxes, shapes = fpn_inputs(device, dtype=torch.float64)
    feats = {k: v.requires_grad_() for k, v in feats.items()}
    names = ["p2", "p3", "p4", "p5"]
    pooler = MultiScaleRoIAlign(names, 7, 2, canonical_scale=112, canonical_level=3)
    out = pooler(feats, boxes, shapes)
    ref = torchvision.ops.MultiScaleRoIAlign(names, 7, 2, canonical_scale=112, canonical_level=3)
    ref_feats = {k: v.detach().cpu().requires_grad_() for k, v in feats.items()}
    expected = ref(ref_feats, [b.cpu() for b in boxes], shapes)
    torch.testing.assert_close(out.cpu(), expected)
    grad = torch.randn_like(expected)
    out.backward(grad.to(device))
    expected.backward(grad)
    for k in names:
        torch.testing.assert_close(feats[k].grad.cpu(), ref_feats[k].grad)


def test_level_mapper_matches_torchvision():
    _, boxes, _ = fpn_inputs("cpu", per_image=(500, 300))
    ours = LevelMapper(2, 5)(boxes)
    theirs = tv_poolers.initLevelMapper(2, 5)(boxes)
    assert torch.equal(ours, theirs)
    assert set(ours.tolist()) == {0, 1, 2, 3}


def test_empty_image_and_no_boxes():
    feats, boxes, shapes = fpn_inputs("cpu")
    boxes[1] = boxes[1][:0]
    out = MultiScaleRoIAlign(["p2", "p3", "p4", "p5"], 7, 2)(feats, boxes, shapes)
    assert out.shape == (boxes[0].shape[0], 8, 7, 7)
    none = MultiScaleRoIAlign(["p2", "p3", "p4", "p5"], 7, 2)(feats, [b[:0] for b in boxes], shapes)
    assert none.shape == (0, 8, 7, 7)


def test_bad_arguments():
    feats, boxes, shapes = fpn_inputs("cpu")
    with pytest.raises(KeyError, match="detops.MultiScaleRoIAlign: feature maps \\['p9'\\]"):
        MultiScaleRoIAlign(["p9"], 7, 2)(feats, boxes, shapes)
    with pytest.raises(ValueError, match="consecutive FPN levels"):
        MultiScaleRoIAlign(["p2", "p4"], 7, 2)(feats, boxes, shapes)
    with pytest.raises(ValueError, match="featmap_names"):
        MultiScaleRoIAlign([], 7, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("output_size,sampling_ratio", [(7, 2), (14, -1)])
def test_sync_free_path_matches_sorted_path(device, output_size, sampling_ratio):
    # The training-mode path on CUDA (every level pools every RoI, the others' boxes moved off
    # the map) gives the values and input gradients of the sorted path, on any device.
    feats, boxes, shapes = fpn_inputs(device)
    names = ["p2", "p3", "p4", "p5"]
    pooler = MultiScaleRoIAlign(names, output_size, sampling_ratio)
    results = []
    for sync_free in (False, True):
        leaves = {k: v.clone().requires_grad_() for k, v in feats.items()}
        if sync_free:
            from detops.ops._utils import boxes_to_rois

            pooler.setup_scales([leaves[n] for n in names], shapes)
            levels = pooler.map_levels(boxes)
            assert levels.unique().numel() == 4  # every level takes part
            out = pooler._forward_without_sync([leaves[n] for n in names], boxes_to_rois(boxes, "t"), levels)
        else:
            out = pooler(leaves, boxes, shapes)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
        out.backward(grad)
        results.append((out.detach(), [leaves[n].grad for n in names]))
    (ref, ref_grads), (got, got_grads) = results
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    for a, b in zip(got_grads, ref_grads):
        # CUDA backward kernels add with atomics: the order, and so the rounding, varies
        torch.testing.assert_close(a, b, **({"rtol": 1e-6, "atol": 1e-6} if device == "cpu" else TOL["cuda"]))


@pytest.mark.cuda
def test_cuda_training_mode_makes_no_host_sync():
    feats, boxes, shapes = fpn_inputs("cuda")
    names = ["p2", "p3", "p4", "p5"]
    pooler = MultiScaleRoIAlign(names, 7, 2)
    with torch.no_grad():
        ref = pooler.eval()(feats, boxes, shapes)
    pooler.train()
    pooler(feats, boxes, shapes)  # scales, kernel attributes: first-call work
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = pooler(feats, boxes, shapes)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
