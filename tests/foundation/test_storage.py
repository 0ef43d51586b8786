"""foundation/storage.py against a local folder and a real S3 HTTP endpoint (moto on loopback)."""
import pytest

from vlcurate.foundation import storage


@pytest.fixture(params=["local", "s3"])
def root(request, tmp_path):
    if request.param == "local":
        return str(tmp_path)
    return request.getfixturevalue("s3").bucket() + "/prefix"


def test_round_trip(root):
    uri = storage.join(root, "a", "b.json")
    assert storage.read_json(uri) is None and not storage.exists(uri)
    storage.write_json(uri, {"x": 1})
    assert storage.read_json(uri) == {"x": 1} and storage.size(uri) > 0
    storage.write_bytes(storage.join(root, "a", "c.bin"), b"abc")
    names = sorted(i.base_name for i in storage.listdir(storage.join(root, "a")))
    assert names == ["b.json", "c.bin"]
    fs, path = storage.resolve(storage.join(root, "a", "c.bin"))
    with fs.open_input_file(path) as f:        # random access: a byte range
        f.seek(1)
        assert f.read(2) == b"bc"
    storage.delete(storage.join(root, "a"))
    assert storage.listdir(storage.join(root, "a")) == []


def test_redact_and_schemes():
    assert storage.redact("s3://AKIA:SECRET@bkt/x?region=eu&secret_key=abc") == \
        "s3://***@bkt/x?region=eu&secret_key=%2A%2A%2A"
    assert storage.redact("/local/path") == "/local/path"
    assert storage.is_local("file:///x") and storage.local_path("file:///x") == "/x"
    assert storage.scheme("gs://b/x") == "gs" and storage.join("s3://b/", "x", "y") == "s3://b/x/y"
    assert storage.join("s3://b/r?region=eu", "x") == "s3://b/r/x?region=eu"
    assert storage.redact_tree({"a": ["s3://K:S@b/x", 3], "b": "/p"}) == {"a": ["s3://***@b/x", 3],
                                                                          "b": "/p"}


def test_upload_and_download_a_folder(root, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(b"a" * 10)
    (src / "sub" / "b.txt").write_text("bee")
    dst = storage.join(root, "work")
    storage.upload_dir(str(src), dst)
    assert sorted(storage.join(dst, i.path.rsplit("/work/", 1)[1]) for i in storage.list_files(dst)) \
        == [storage.join(dst, "a.bin"), storage.join(dst, "sub", "b.txt")]
    back = tmp_path / "back"
    storage.download_dir(dst, str(back))
    assert (back / "a.bin").read_bytes() == b"a" * 10 and (back / "sub" / "b.txt").read_text() == "bee"
    storage.download_dir(storage.join(root, "nothing"), str(tmp_path / "empty"))
    assert (tmp_path / "empty").is_dir() and not list((tmp_path / "empty").iterdir())
