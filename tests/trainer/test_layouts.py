"""export.layout: the image layout (one sample per image, every kept caption in its json) and
the pair layout (one sample per row) give the trainer the same rows: the same image bytes,
caption and annotations, read natively from either; the image layout stores each image once."""
from __future__ import annotations

import tarfile

import numpy as np
import pytest

from tests.pipeline.test_ray import open_clip_loader
from tests.trainer.test_trainer import dag
from vlcurate.pipeline import config as C
from vlcurate.pipeline.demo import demo_overrides, make_demo
from vlcurate.pipeline.runner import run
from vlcurate.schemas import F
from vlcurate.schemas import mining as MI
from vlcurate.foundation.layout import PER_IMAGE
from vlcurate.trainer.data import ShardSet


def captions_together(data, n_images: int = 10) -> None:
    """Two more captions for each of the first demo images, right after its line (COCO lists an
    image's captions together): raw lines, so the demo's odd rows stay as they are."""
    lines = (data / "captions.csv").read_bytes().split(b"\n")
    out, done = [], 0
    for line in lines:
        out.append(line)
        if line.startswith(b"demo-") and done < n_images:
            key, image = line.split(b",")[:2]
            out += [b"%s-b,%s,a photo with a dog and a cat %d" % (key, image, done),
                    b"%s-c,%s,a dog running in a park %d" % (key, image, done)]
            done += 1
    (data / "captions.csv").write_bytes(b"\n".join(out))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    data = make_demo(root / "data", n=30, seed=2)
    captions_together(data)
    cfg = C.load(None, {**demo_overrides(data, root / "run"), "run.progress": False,
                        "export.samples_per_shard": 12})
    run(cfg, dag=dag(), executor="local", log=lambda _: None)
    image = cfg.replace(**{"export.layout": "image", "export.out_dir": str(root / "image")})
    run(image, dag=dag(), executor="local", log=lambda _: None, only={"export"})
    return ShardSet(root / "run" / "export" / "shards"), ShardSet(root / "image" / "shards")


def _members(shards: ShardSet) -> list[str]:
    out = []
    for tar in sorted(shards.uri and __import__("pathlib").Path(shards.uri).glob("*.tar")):
        with tarfile.open(tar) as tf:
            out += [m.name for m in tf.getmembers()]
    return out


def first_of_sample(image: ShardSet, sample_id: str) -> str:
    """The first caption's sample_id of the image sample holding ``sample_id`` (its per-image
    annotations are that row's)."""
    ix = image.index
    r = ix.row(sample_id)
    off = ix.num[F.SH_JPG_OFFSET.name]
    rows = np.flatnonzero((ix.code == ix.code[r]) & (off == off[r]) & (ix.caption == 0))
    return ix.ids[int(rows[0])].as_py()


def test_both_layouts_give_the_trainer_the_same_rows(exports):
    pair, image = exports
    assert len(pair) == len(image) > 0
    groups = {}
    for row in range(len(pair)):
        s = pair.sample(row)
        groups.setdefault(s.group, set()).add(s.key)
    assert any(len(g) > 1 for g in groups.values())        # the data has multi-caption images
    for row in range(len(pair)):
        a = pair.sample(row)
        b = image.fetch(a.key)
        assert (b.key, b.image, b.caption, b.group) == (a.key, a.image, a.caption, a.group)
        own = groups[a.group]
        want = dict(a.meta)
        pos = want.get(MI.POSITIVE_IDS.name) or []
        keep = [j for j, p in enumerate(pos) if p not in own]
        for col in (MI.POSITIVE_IDS.name, MI.POSITIVE_RELATIONS.name):
            if want.get(col) is not None:
                want[col] = [want[col][j] for j in keep]
        lead = pair.fetch(first_of_sample(image, a.key)).meta     # the sample's first caption
        want.update({k: v for k, v in lead.items() if k in PER_IMAGE})
        assert b.meta == want


def test_the_image_layout_stores_each_image_once(exports):
    pair, image = exports
    jpgs = [m for m in _members(image) if m.endswith(".jpg")]
    n_groups = len(set(image.index.group_hash.tolist()))
    assert len(jpgs) == n_groups < len(pair)                 # one sample per image
    # what a WebDataset trainer (open_clip) sees: one jpg + txt + json per image
    names = _members(image)
    assert len([m for m in names if m.endswith(".txt")]) == len(jpgs)
    assert sum(1 for m in _members(pair) if m.endswith(".jpg")) == len(pair)
    assert F.IMAGE_GROUP.name in image.sample(0).meta


def test_embeddings_go_in_only_when_asked_as_binary_members(tmp_path):
    """export.embeddings adds embed's vectors as .npy members (never JSON numbers); without it
    a sample holds jpg, txt and json only."""
    import io

    import pyarrow.dataset as ds
    data = make_demo(tmp_path / "data", n=12, seed=4)
    captions_together(data, 3)
    cfg = C.load(None, {**demo_overrides(data, tmp_path / "run"), "run.progress": False,
                        "run.stages": ["ids", "embed"], "export.layout": "image",
                        "export.embeddings": ["image_emb", "text_emb"]})
    run(cfg, executor="local", log=lambda _: None)
    emb = ds.dataset(tmp_path / "run" / "embed" / "data", format="parquet").to_table()
    by_id = dict(zip(emb.column(F.SAMPLE_ID.name).to_pylist(),
                     emb.column("text_emb").to_pylist()))
    shards = ShardSet(tmp_path / "run" / "export" / "shards")
    tars = sorted((tmp_path / "run" / "export" / "shards").glob("*.tar"))
    with tarfile.open(tars[0]) as tf:
        names = [m.name for m in tf.getmembers()]
        key = names[0].split(".")[0]
        text = np.load(io.BytesIO(tf.extractfile(f"{key}.text_emb.npy").read()))
        image = np.load(io.BytesIO(tf.extractfile(f"{key}.image_emb.npy").read()))
    rows = [r for r in range(len(shards)) if shards.index.ids[r].as_py() and
            shards.sample(r).meta[F.IMAGE_GROUP.name] == key]
    ids = [shards.index.ids[r].as_py() for r in rows]
    assert text.shape == (len(ids), len(by_id[ids[0]])) and image.shape[0] == len(ids)
    assert np.allclose(text, np.array([by_id[i] for i in ids], np.float32))
    assert not any("emb" in k for k in shards.sample(rows[0]).meta)    # never in the json
    assert {n.split(".", 1)[1] for n in names} == {"jpg", "txt", "json", "image_emb.npy",
                                                   "text_emb.npy"}


def test_open_clip_reads_the_image_layout_one_caption_per_image(exports):
    """What open_clip's own WebDataset loader sees in the image layout: one (image, text) pair
    per image, sized from sizes.json."""
    import math
    _, image = exports
    tars = sorted(__import__("pathlib").Path(image.uri).glob("*.tar"))
    n_images = len(set(image.index.group_hash.tolist()))
    info = open_clip_loader(tars, batch_size=4)
    # open_clip sizes the epoch from sizes.json: one sample per image (rounded up to batches)
    assert info.dataloader.num_batches == math.ceil(n_images / 4)
    for images, texts in info.dataloader:
        assert images.shape[1:] == (3, 224, 224) and texts.shape[1] == 77
