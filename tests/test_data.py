"""The shapes dataset, the COCO-format dataset, transforms and the training batch order."""
import json
import logging
import os

import numpy as np
import pytest
import torch

from detops.data import COCODataset, IterationBatchSampler, ShapesDataset, build_dataset, collate, encode_masks
from detops.data.transforms import Compose, RandomHorizontalFlip
from detops.engine.launch import setup_cfg


def test_shapes_is_deterministic_by_seed():
    a, b, c = ShapesDataset(5, seed=3), ShapesDataset(5, seed=3), ShapesDataset(5, seed=4)
    for i in range(5):
        (ia, ta), (ib, tb), (ic, _) = a[i], b[i], c[i]
        assert torch.equal(ia, ib)
        for k in ("boxes", "labels", "masks"):
            assert torch.equal(ta[k], tb[k])
        assert not torch.equal(ia, ic)


def test_shapes_annotations_are_valid():
    ds = ShapesDataset(40, seed=0, image_size=96, min_obj_size=10, max_obj_size=40)
    counts = np.zeros(4, dtype=int)
    for i in range(len(ds)):
        img, t = ds[i]
        assert img.shape == (3, 96, 96) and img.dtype == torch.float32
        assert 0 <= float(img.min()) and float(img.max()) <= 1
        boxes, labels, masks = t["boxes"], t["labels"], t["masks"]
        assert len(boxes) == len(labels) == len(masks) >= 1
        assert masks.shape[1:] == (96, 96) and masks.dtype == torch.uint8
        assert ((labels >= 1) & (labels <= 3)).all()
        assert (boxes[:, 0] >= 0).all() and (boxes[:, 1] >= 0).all()
        assert (boxes[:, 2] <= 96).all() and (boxes[:, 3] <= 96).all()
        assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all()
        for b, m in zip(boxes, masks):  # every box is the tight box of its mask
            ys, xs = torch.nonzero(m, as_tuple=True)
            assert b.tolist() == [xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1]
        counts[labels.numpy()] += 1
    assert (counts[1:] > 0).all()  # every class appears


def test_shapes_splits_and_sizes_come_from_the_config():
    cfg = setup_cfg("", ["DATASETS.SHAPES.NUM_TRAIN", 7, "DATASETS.SHAPES.NUM_VAL", 3, "DATASETS.SHAPES.IMAGE_SIZE", 64,
                         "DATASETS.SHAPES.MIN_OBJ_SIZE", 10, "DATASETS.SHAPES.MAX_OBJ_SIZE", 30])
    tr, va = build_dataset(cfg, "shapes_train", True), build_dataset(cfg, "shapes_val", False)
    assert len(tr) == 7 and len(va) == 3
    assert tr[0][0].shape == (3, 64, 64)
    assert not torch.equal(tr[(0, None)][0], va[0][0])
    gt = va.coco
    assert len(gt.imgs) == 3 and len(gt.anns) == sum(len(va[i][1]["boxes"]) for i in range(3))


def test_flip_moves_boxes_with_masks():
    img, t = ShapesDataset(1, seed=1)[0]
    f_img, f_t = Compose([RandomHorizontalFlip(1.0)])(img, t, 0)
    assert torch.equal(f_img, img.flip(-1))
    for b, m in zip(f_t["boxes"], f_t["masks"]):
        ys, xs = torch.nonzero(m, as_tuple=True)
        assert b.tolist() == [xs.min().item(), ys.min().item(), xs.max().item() + 1, ys.max().item() + 1]


def test_batch_order_depends_only_on_seed_and_iteration():
    full = list(IterationBatchSampler(10, 4, seed=5, start_iter=0, max_iter=8))
    resumed = list(IterationBatchSampler(10, 4, seed=5, start_iter=5, max_iter=8))
    assert resumed == full[5:]
    epoch0 = [i for b in full for i, _ in b][:10]
    assert sorted(epoch0) == list(range(10))
    # two processes split each global batch between them
    r0 = list(IterationBatchSampler(10, 4, 5, 0, 8, rank=0, world_size=2))
    r1 = list(IterationBatchSampler(10, 4, 5, 0, 8, rank=1, world_size=2))
    for g, a, b in zip(full, r0, r1):
        assert sorted(a + b) == sorted(g)


# ---------------------------------------------------------------------------- COCO format
def write_coco(root, n_images=4, size=64, seed=0, extra_annotations=(), corrupt=()):
    """A tiny COCO-format dataset made of shapes images, with category ids 10, 20, 30."""
    from PIL import Image
    img_dir = os.path.join(root, "images")
    os.makedirs(img_dir, exist_ok=True)
    ds = ShapesDataset(n_images, seed=seed, image_size=size, min_obj_size=10, max_obj_size=size // 2)
    images, anns = [], []
    for i in range(n_images):
        img, t = ds[i]
        name = f"img_{i}.png"
        path = os.path.join(img_dir, name)
        if i in corrupt:
            with open(path, "wb") as f:
                f.write(b"not a png at all")
        else:
            Image.fromarray((img.permute(1, 2, 0).numpy() * 255).astype(np.uint8)).save(path)
        images.append({"id": 100 + i, "file_name": name, "height": size, "width": size})
        for b, l, rle in zip(t["boxes"].tolist(), t["labels"].tolist(), encode_masks(t["masks"].numpy())):
            anns.append({"id": len(anns) + 1, "image_id": 100 + i, "category_id": 10 * l, "iscrowd": 0,
                         "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]], "area": (b[2] - b[0]) * (b[3] - b[1]),
                         "segmentation": rle})
    for a in extra_annotations:
        anns.append(dict(a, id=len(anns) + 1))
    cats = [{"id": 10, "name": "circle"}, {"id": 20, "name": "square"}, {"id": 30, "name": "triangle"}]
    ann_file = os.path.join(root, "annotations.json")
    with open(ann_file, "w") as f:
        json.dump({"images": images, "annotations": anns, "categories": cats}, f)
    return img_dir, ann_file


def test_coco_dataset_reads_boxes_masks_and_maps_categories(tmp_path):
    img_dir, ann = write_coco(str(tmp_path))
    ds = COCODataset(img_dir, ann)
    ref = ShapesDataset(4, seed=0, image_size=64, min_obj_size=10, max_obj_size=32)
    assert ds.contiguous_to_category == {1: 10, 2: 20, 3: 30}
    img, t = ds[0]
    r_img, r_t = ref[0]
    assert img.shape == r_img.shape and (img - r_img).abs().max() <= 1 / 255 + 1e-6
    assert torch.equal(t["labels"], r_t["labels"]) and torch.allclose(t["boxes"], r_t["boxes"])
    assert torch.equal(t["masks"], r_t["masks"])
    assert t["image_id"] == 100


def test_coco_bad_annotations_are_skipped_with_a_message(tmp_path, caplog):
    bad = [{"image_id": 100, "category_id": 20, "bbox": [5, 5, 0, 10], "iscrowd": 0, "area": 0},
           {"image_id": 100, "category_id": 99, "bbox": [5, 5, 10, 10], "iscrowd": 0, "area": 100}]
    img_dir, ann = write_coco(str(tmp_path), extra_annotations=bad)
    with caplog.at_level(logging.WARNING, logger="detops.data"):
        ds = COCODataset(img_dir, ann)
    assert "degenerate box [5, 5, 0, 10]" in caplog.text
    assert "unknown category_id 99" in caplog.text
    assert len(ds[0][1]["boxes"]) == len(ShapesDataset(4, seed=0, image_size=64, min_obj_size=10,
                                                       max_obj_size=32)[0][1]["boxes"])


def test_corrupt_image_is_skipped_with_a_message(tmp_path, caplog):
    img_dir, ann = write_coco(str(tmp_path), corrupt=(1,))
    ds = COCODataset(img_dir, ann)
    with caplog.at_level(logging.WARNING, logger="detops.data"):
        assert ds[1] is None
    assert "img_1.png" in caplog.text and "cannot read it" in caplog.text
    images, targets = collate([ds[0], ds[1], ds[2]])
    assert len(images) == len(targets) == 2


def test_missing_dataset_path_names_the_path_and_the_key(tmp_path):
    cfg = setup_cfg("", ["DATASETS.COCO_ROOTS", [["mine", str(tmp_path / "nope"), str(tmp_path / "a.json")]]])
    with pytest.raises(FileNotFoundError, match=r"image folder '.*nope' does not exist \(set by DATASETS.COCO_ROOTS"):
        build_dataset(cfg, "mine", True)
    cfg = setup_cfg("", ["DATASETS.DATA_DIR", str(tmp_path)])
    with pytest.raises(FileNotFoundError, match=r"coco/train2017' does not exist \(set by DATASETS.DATA_DIR"):
        build_dataset(cfg, "coco_2017_train", True)
    with pytest.raises(KeyError, match="unknown dataset 'nothing'"):
        build_dataset(cfg, "nothing", True)
