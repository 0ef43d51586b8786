"""Concept targets: WordNet canonicalisation (Debian's wordnet-base), the vocabulary, the teacher
heads on synthetic features, top-k targets, the teacher loading policy."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlcurate.pipeline import config as C
from vlcurate.stages.concepts.stage import ConceptsParams
from vlcurate.foundation import models
from vlcurate.stages.concepts import heads as H
from vlcurate.stages.concepts import vocab as V
from vlcurate.stages.concepts.teacher import Teacher
from vlcurate.stages.concepts.wordnet import WordNet, WordNetMissing

WORDNET = "/usr/share/wordnet"


@pytest.fixture(scope="module")
def wn():
    try:
        return WordNet(WORDNET)
    except WordNetMissing as e:
        pytest.skip(f"{e}")


def test_wordnet_canonicalisation(wn):
    name = lambda w, pos="n": wn.canonical(w, pos).name  # noqa: E731
    # plurals and irregular forms go to the word's most frequent noun sense
    assert name("dogs") == name("dog") == "dog.n.01"
    assert name("puppies") == "puppy.n.01"            # WordNet's own synset: "a young dog" ...
    assert "dog.n.01" in [h.name for h in wn.hypernyms(wn.canonical("puppies", "n"))]  # ... a dog
    assert name("cars") == name("automobiles") == name("auto") == "car.n.01"   # synonyms merge
    assert name("mice") == "mouse.n.01" and name("children") == "child.n.01"
    assert name("women") == "woman.n.01" and name("buses") == "bus.n.01"
    assert name("glasses") == "spectacles.n.01"
    # adjectives: satellites named like nltk, comparatives via morphy
    assert name("red", "a") == name("reddish", "a") == name("redder", "a") == "red.s.01"
    assert name("big", "a") == "large.a.01"
    assert wn.canonical("xyzzy", "n") is None and wn.canonical("dog", "a") is None
    assert "canine" in wn.canonical("dog", "n").gloss or "Canis" in wn.canonical("dog", "n").gloss


def test_missing_wordnet_says_what_to_install(tmp_path):
    with pytest.raises(WordNetMissing, match="apt-get install wordnet-base"):
        WordNet(tmp_path)


def vcfg(**kw) -> ConceptsParams:
    base = {"min_object_count": 3, "min_attribute_count": 3, "min_sharedness": 2}
    return C.from_dict({"concepts": {**base, **kw}}).concepts


def test_vocabulary_cutoffs_sharedness_and_backoff(wn):
    objects = [["dog", "ball"]] * 3 + [["dogs"], ["car", "dog"], ["automobile"], ["cars"],
                                       ["puppies"], ["puppy", "ball"], ["xyzzy"]]
    attributes = [["red"], ["reddish"], ["big"], ["red"], ["red", "stone"], ["big"], [], [], [], []]
    obj, att, obj_lab, _ = V.build(objects, attributes, wn, vcfg())
    assert obj.names == ["dog.n.01", "ball.n.01", "car.n.01"]     # puppy.n.01: 2 < 3 images
    assert obj.count["dog.n.01"] == 5 and obj.count["car.n.01"] == 3
    assert obj.words["car.n.01"] == {"car": 1, "automobile": 1, "cars": 1}
    assert V.to_ids(obj_lab, obj)[:5] == [[0, 1]] * 3 + [[0], [2, 0]]
    assert V.to_ids(obj_lab, obj)[7:] == [[], [1], []]              # puppies dropped (DiHT)
    # red: 4 images with dog, ball, car (sharedness 3); big: 2 images -> under the cutoff
    assert att.names == ["red.s.01"] and att.sharedness["red.s.01"] == 3
    assert V.build(objects, attributes, wn, vcfg(min_sharedness=4))[1].names == []
    # hypernym backoff (off by default): puppies count as their nearest kept hypernym, dog
    _, _, lab, _ = V.build(objects, attributes, wn, vcfg(hypernym_backoff=True))
    assert lab[7] == ["dog.n.01"] and lab[8] == ["dog.n.01", "ball.n.01"] and lab[9] == []
    rows = obj.rows()
    assert rows[0]["synset"] == "dog.n.01" and rows[0]["words"][0] == "dog"


@pytest.mark.parametrize("backoff", [False, True])
def test_the_vocabulary_counts_every_row_even_when_labels_are_a_sample(wn, backoff):
    """The concepts stage trains on a sample but tallies every kept row, part by part: the
    vocabulary (names, counts, words, sharedness) equals one built on all rows at once, and the
    sample's labels equal those rows' labels in the full build."""
    objects = [["dog", "ball"]] * 3 + [["dogs"], ["car", "dog"], ["automobile"], ["cars"],
                                       ["puppies"], ["puppy", "ball"], ["xyzzy"]]
    attributes = [["red"], ["reddish"], ["big"], ["red"], ["red", "stone"], ["big"], [], [], [], []]
    cfg = vcfg(hypernym_backoff=backoff)
    full = V.build(objects, attributes, wn, cfg)
    tally = V.Tally(wn)
    for lo in range(0, len(objects), 3):                       # three parts, then one of one row
        tally.add(objects[lo:lo + 3], attributes[lo:lo + 3])
    sample = [0, 4, 7, 8]
    part = V.build([objects[i] for i in sample], [attributes[i] for i in sample], wn, cfg, tally)
    for a, b in zip(full[:2], part[:2]):
        assert (a.names, a.count, a.words, a.sharedness) == (b.names, b.count, b.words,
                                                              b.sharedness)
    assert part[2] == [full[2][i] for i in sample] and part[3] == [full[3][i] for i in sample]
    assert tally.n_images == len(objects)
    # the sample alone would see other counts: dog in 2 of 4 rows, under the cutoff of 3
    assert "dog.n.01" not in V.build([objects[i] for i in sample],
                                     [attributes[i] for i in sample], wn, cfg)[0].names


def synthetic(n=1500, d=24, n_classes=8, seed=0):
    """Separable features: an image's feature is the sum of its concepts' means, plus noise;
    concept frequencies are long-tailed."""
    rng = np.random.default_rng(seed)
    means = rng.normal(size=(n_classes, d)) * 2
    freq = np.array([0.4, 0.2, 0.1, 0.1, 0.08, 0.06, 0.04, 0.02])[:n_classes]
    p = freq / freq.sum()
    labels = [sorted(set(rng.choice(n_classes, size=rng.integers(1, 3), p=p).tolist()))
              for _ in range(n)]
    x = np.stack([means[lab].sum(0) for lab in labels]) + rng.normal(size=(n, d)) * 0.5
    return x.astype(np.float16), labels


def hcfg(**kw) -> ConceptsParams:
    kw = {"base_lr": 0.05, "epochs": 4, "batch_size": 128, **kw}
    return C.from_dict({"concepts": kw}).concepts


def test_heads_recover_the_labels_of_separable_features():
    x, labels = synthetic()
    head = H.train_head(x, labels, 8, hcfg())
    ids, probs = H.top_k(head, x, 10)
    recovered = np.mean([set(ids[i, :len(lab)].tolist()) == set(lab)
                         for i, lab in enumerate(labels)])
    assert recovered > 0.97
    # soft targets: an image with two concepts gets about half the mass on each
    two = [i for i, lab in enumerate(labels) if len(lab) == 2][:50]
    assert np.median(probs[two, 0]) < 0.75 and np.median(probs[two, :2].sum(1)) > 0.9
    # deterministic: same seed, same head
    again = H.train_head(x, labels, 8, hcfg())
    assert np.array_equal(again.weight, head.weight)
    assert H.train_head(x, [[]] * len(x), 8, hcfg()) is None


def test_soft_targets_and_inverse_sqrt_resampling():
    lab = H.Labels([[0, 2], [1], [], [2]])
    t = lab.soft(np.array([0, 3, 0]), 3).numpy()
    assert np.allclose(t, [[0.5, 0, 0.5], [0, 0, 1], [0.5, 0, 0.5]])
    # 100 images of concept 0, 4 of concept 1: weights 1/10 and 1/2 (max over an image's concepts)
    labels = [[0]] * 100 + [[1]] * 4 + [[0, 1]]
    w = H.resample_weights(labels, 2)
    assert w[0] == pytest.approx(101 ** -0.5) and w[100] == pytest.approx(5 ** -0.5)
    assert w[104] == pytest.approx(5 ** -0.5)
    # a concept's share of the draws goes from n_c to about sqrt(n_c)
    labels = [[0]] * 400 + [[1]] * 25
    w = H.resample_weights(labels, 2)
    share = w[400:].sum() / w.sum()
    assert share == pytest.approx(5 / (20 + 5))


def test_top_k_renormalised_and_sorted():
    rng = np.random.default_rng(1)
    head = H.Head(np.zeros(6, np.float32), np.ones(6, np.float32),
                  rng.normal(size=(30, 6)).astype(np.float32), np.zeros(30, np.float32))
    x = rng.normal(size=(50, 6)).astype(np.float32)
    ids, probs = H.top_k(head, x, 10)
    assert ids.shape == probs.shape == (50, 10)
    assert np.allclose(probs.sum(1), 1, atol=1e-6)
    assert np.allclose(probs.astype(np.float16).astype(np.float32).sum(1), 1, atol=5e-3)
    assert (np.diff(probs, axis=1) <= 0).all()
    full = np.exp(head.logits(x))
    assert (np.argsort(-full, axis=1)[:, :10] == ids).mean() > 0.99   # the 10 most probable
    assert all(len(set(r)) == 10 for r in ids.tolist())
    ids3, p3 = H.top_k(head, x, 50)           # k larger than the vocabulary: all of it
    assert ids3.shape == (50, 30) and np.allclose(p3.sum(1), 1, atol=1e-6)
    assert H.top_k(None, x, 10)[0].shape == (50, 0)


def test_visualness_separates_visible_from_invisible_attributes():
    x, labels = synthetic(n=2000)
    rng = np.random.default_rng(3)
    # attribute 0 follows concept 0 (visible); attribute 1 is a coin flip (not visible)
    attrs = [([0] if 0 in lab else []) + ([1] if rng.random() < 0.3 else []) for lab in labels]
    vis = H.visualness(x, attrs, 2, hcfg())
    assert vis[0] > 0.95 and abs(vis[1] - 0.5) < 0.1
    keep = H.select_attributes(["a.s.01", "b.s.01"], vis, {}, hcfg(min_visualness=0.6))
    assert keep == ["a.s.01"]
    assert H.select_attributes(["a", "b"], np.array([np.nan, 0.7]), {}, hcfg(max_attributes=1)) \
        == ["b"]
    names = ["a", "b", "c"]      # the cap keeps the best two, in the vocabulary's order
    assert H.select_attributes(names, np.array([0.8, 0.9, 0.7]), {}, hcfg(max_attributes=2)) \
        == ["a", "b"]
    assert H.auc(np.array([0.1, 0.4, 0.35, 0.8]), np.array([False, False, True, True])) == 0.75


def jpeg(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), colour).save(buf, "JPEG")
    return buf.getvalue()


def test_teacher_missing_weights_error_and_local_file(tmp_path, monkeypatch):
    import torch
    import torchvision
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path / "hub"))
    with pytest.raises(models.ModelNotFound) as e:
        models.load_backbone(ConceptsParams().teacher)
    msg = str(e.value)
    for needle in ("torchvision/vit_h_14", "vit_h_14_lc_swag-c1eb923e.pth", "`path`",
                   "allow_download", "random_init"):
        assert needle in msg
    # a torchvision state dict from a local file: the classifier is dropped, features match
    torch.manual_seed(0)
    ref = torchvision.models.mobilenet_v3_small(num_classes=10).eval()
    torch.save(ref.state_dict(), tmp_path / "mnv3.pth")
    spec = C.ModelSpec(id="torchvision/mobilenet_v3_small", path=str(tmp_path / "mnv3.pth"),
                       options=C.FrozenMap({"num_classes": 10}))
    t = Teacher(spec)
    assert t.loaded.source == str(tmp_path / "mnv3.pth") and not t.loaded.random
    feats = t.encode([jpeg((200, 10, 10)), jpeg((10, 10, 200))], batch_size=2)
    x = torch.stack([t.transform(Image.open(io.BytesIO(jpeg((200, 10, 10)))).convert("RGB"))])
    with torch.no_grad():
        want = torch.flatten(ref.avgpool(ref.features(x)), 1).numpy()
    assert feats.shape == (2, 576) and np.allclose(feats[:1], want, atol=1e-4)
    # a timm backbone (random, tiny) gives pre-logits features
    tiny = C.ModelSpec(id="vit_tiny_patch16_224", random_init=True, options=C.FrozenMap(
        {"img_size": 32, "patch_size": 8, "depth": 2, "embed_dim": 48, "num_heads": 2}))
    assert Teacher(tiny).encode([jpeg((0, 0, 0))], 4).shape == (1, 48)
    assert Path(tmp_path / "mnv3.pth").exists()


def test_an_empty_vocabulary_names_the_key_to_lower(wn):
    objects = [["dog", "ball"]] * 3 + [["car", "dog"]]
    attributes = [["red"], ["red"], ["big"], ["red"]]
    n = len(objects)
    obj, att, _, _ = V.build(objects, attributes, wn, vcfg(min_object_count=5))
    assert V.emptiness(obj, att, n, vcfg(min_object_count=5)) == (
        "concepts: empty object vocabulary: no noun synset is in concepts.min_object_count=5 of "
        "the 4 kept images (the most frequent is in 4); lower concepts.min_object_count (DiHT's "
        "250 is for LAION scale)")
    c = vcfg(min_attribute_count=250)
    obj, att, _, _ = V.build(objects, attributes, wn, c)
    assert obj.names and not att.names
    assert V.emptiness(obj, att, n, c) == (
        "concepts: empty attribute vocabulary over 4 kept images: 0 adjective synsets reach "
        "concepts.min_attribute_count=250 (the most frequent is in 3 images) and 2 reach "
        "concepts.min_sharedness=2, none both; lower concepts.min_attribute_count (DiHT's 250 "
        "is for LAION scale) or concepts.min_sharedness")
    ok = vcfg(min_sharedness=1)
    obj, att, _, _ = V.build(objects, attributes, wn, ok)
    assert att.names == ["red.s.01"] and V.emptiness(obj, att, n, ok) is None
    assert "concepts.min_visualness=0.6" in V.emptiness(obj, att.keep([]), n, ok, "visualness")
    assert V.emptiness(obj.keep([]), att.keep([]), 0, ok) is None     # no rows: nothing to say
