"""Imagenette from its archive: a small real .tgz of JPEGs in the official layout, served by a
real HTTP server on 127.0.0.1 through $SPEEDRUN_MIRROR, checked with a spec of its own counts."""
import io
import tarfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from speedrun.data.pipeline.dataset import FolderSource, open_source
from speedrun.data.sources.download import md5sum
from speedrun.data.sources.imagenette import CLASSES, OFFICIAL, ImagenetteSpec, resolve_imagenette
from speedrun.errors import DataError
from speedrun.recipe import load_recipe

from test_data import _closed_port, serve  # noqa: F401  (serve: the real HTTP server fixture)

TRAIN, VAL = 3, 2                       # images per class in the small archive


def jpeg(seed: int, side: int = 24) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side + 4, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=80)
    return out.getvalue()


def layout(drop: str | None = None, train: int = TRAIN) -> dict[str, bytes]:
    """Member name -> bytes of an archive in the official layout (``drop``: a member folder left out)."""
    members, seed = {}, 0
    for split, n in (("train", train), ("val", VAL)):
        for cls in CLASSES:
            if drop == f"{split}/{cls}":
                continue
            for i in range(n):
                seed += 1
                members[f"imagenette2-160/{split}/{cls}/{cls}_{i}.JPEG"] = jpeg(seed)
    members["imagenette2-160/noisy_imagenette.csv"] = b"path,noisy_labels_0\n"
    return members


def make_archive(path: Path, members: dict[str, bytes]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def spec_of(archive: Path, train: int = TRAIN * 10, val: int = VAL * 10) -> ImagenetteSpec:
    """The official 160 px spec with this archive's size, md5 and counts."""
    return replace(OFFICIAL[160], size=archive.stat().st_size, md5=md5sum(archive), train=train, val=val)


@pytest.fixture
def recipe():
    return load_recipe("folder", ["data.dataset=imagenette"])


@pytest.fixture
def site(tmp_path, isolated_env, monkeypatch, serve):  # noqa: F811
    """A folder served as $SPEEDRUN_MIRROR."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.setenv("SPEEDRUN_MIRROR", serve(folder))
    return folder


def test_download_verify_unpack_then_found_without_the_network(tmp_path, site, recipe, monkeypatch):
    spec = spec_of(make_archive(site / "imagenette2-160.tgz", layout()))
    dest = tmp_path / "data"
    resolved = resolve_imagenette(recipe, dest, spec)
    folder = dest / "imagenette2-160"
    assert resolved.data.dataset == "folder" and resolved.data.path == str(folder)
    assert resolved.model == recipe.model and resolved.data.batch_size == recipe.data.batch_size
    assert sorted(p.name for p in dest.iterdir()) == ["imagenette2-160", "imagenette2-160.tgz"]   # no staging
    assert sorted(p.name for p in (folder / "val").iterdir()) == sorted(CLASSES)
    assert len(list((folder / "train").rglob("*.JPEG"))) == 30 and len(list((folder / "val").rglob("*.JPEG"))) == 20

    monkeypatch.setenv("SPEEDRUN_MIRROR", f"http://127.0.0.1:{_closed_port()}/")    # no network from here on
    assert resolve_imagenette(recipe, dest, spec).data.path == str(folder)
    # the archive alone, in $SPEEDRUN_DATA, is unpacked beside it without the network
    other = tmp_path / "other"
    (other / "imagenette2-160.tgz").parent.mkdir()
    (other / "imagenette2-160.tgz").write_bytes((dest / "imagenette2-160.tgz").read_bytes())
    monkeypatch.setenv("SPEEDRUN_DATA", str(other))
    assert resolve_imagenette(recipe, None, spec).data.path == str(other / "imagenette2-160")


def bad_archives(site: Path) -> dict:
    """name -> (the served archive's spec, what the error must name besides the archive)."""
    good = make_archive(site / "good.tgz", layout())
    cut = site / "cut.tgz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    traversal = layout()
    traversal["imagenette2-160/../../escaped.JPEG"] = jpeg(0)
    return {
        "truncated": (spec_of(good), cut, ["truncated", f"expected {good.stat().st_size:,}"]),
        "truncated, size and md5 unknown": (replace(spec_of(good), size=None, md5=None), cut,
                                            ["truncated or corrupt"]),
        "missing class": (None, make_archive(site / "missing.tgz", layout(drop="val/n03888257")),
                          ["member imagenette2-160/val/n03888257: missing"]),
        "wrong count": (None, make_archive(site / "count.tgz", layout(train=TRAIN - 1) | {
            f"imagenette2-160/train/{c}/{c}_x.JPEG": jpeg(9) for c in CLASSES[:9]}),
            ["member imagenette2-160/train: holds 29 images, expected 30"]),
        "path traversal": (None, make_archive(site / "evil.tgz", traversal),
                           ["refusing to extract member", "imagenette2-160/../../escaped.JPEG"]),
    }


@pytest.mark.parametrize("case", ["truncated", "truncated, size and md5 unknown", "missing class", "wrong count",
                                  "path traversal"])
def test_a_bad_archive_is_named_and_leaves_nothing(tmp_path, site, recipe, case):
    spec, archive, named = bad_archives(site)[case]
    spec = spec or spec_of(archive)                   # its own size and md5: the content is what is checked
    (site / "imagenette2-160.tgz").write_bytes(archive.read_bytes())
    dest = tmp_path / "data"
    with pytest.raises(DataError) as err:
        resolve_imagenette(recipe, dest, spec)
    msg = str(err.value)
    assert msg.startswith(f"{dest / 'imagenette2-160.tgz'}: "), msg         # the archive, by its own name
    assert all(n in msg for n in named), msg
    assert ".imagenette2-160-" not in msg and "\n" not in msg                 # no staging path; one message
    assert not dest.exists()       # no partial folder; the refused download and the folder made for it removed
    assert not (tmp_path / "escaped.JPEG").exists() and not (dest.parent / "escaped.JPEG").exists()


def test_a_bad_archive_of_the_users_is_kept_and_named(tmp_path, isolated_env, recipe):
    dest = tmp_path / "data"
    archive = make_archive(dest / "imagenette2-160.tgz", layout(drop="train/n01440764"))
    with pytest.raises(DataError, match=r"imagenette2-160.tgz: member imagenette2-160/train/n01440764: missing.*"
                                        r"Delete .*imagenette2-160.tgz and let speedrun download it again"):
        resolve_imagenette(recipe, dest, spec_of(archive))
    assert [p.name for p in dest.iterdir()] == ["imagenette2-160.tgz"]


def test_an_unpacked_copy_given_as_data_dir_is_used_in_place(tmp_path, isolated_env, recipe, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_MIRROR", f"http://127.0.0.1:{_closed_port()}/")
    given = tmp_path / "my-imagenette"
    for name, data in layout().items():
        path = given / Path(name).relative_to("imagenette2-160")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    before = sorted(p.relative_to(given) for p in given.rglob("*"))
    # the official spec: a copy the user points at is used as it is (classes checked, counts not)
    resolved, source = open_source(recipe, given)
    assert resolved.data.dataset == "folder" and resolved.data.path == str(given)
    assert isinstance(source, FolderSource) and source.classes == sorted(CLASSES)
    assert len(source.train_y) == 30 and len(source.test_y) == 20
    assert sorted(p.relative_to(given) for p in given.rglob("*")) == before             # nothing written there

    for cls in ("n03888257", "n03445777"):
        for f in (given / "val" / cls).iterdir():
            f.unlink()
        (given / "val" / cls).rmdir()
    with pytest.raises(DataError, match=rf"{given / 'val'}/n03445777: missing \(and 1 more class folders\).*"
                                        "--set data.dataset=folder"):
        open_source(recipe, given)


def test_the_320_archive_is_asked_for(tmp_path, isolated_env, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_MIRROR", f"http://127.0.0.1:{_closed_port()}/")
    recipe = load_recipe("folder", ["data.dataset=imagenette", "data.imagenette_size=320"])
    empty = tmp_path / "empty"
    with pytest.raises(DataError) as err:
        resolve_imagenette(recipe, empty)
    msg = str(err.value)
    assert "imagenette2-320.tgz" in msg and "download failed" in msg and str(empty / "imagenette2-320") in msg
    assert not empty.exists()                        # the folder made for the download is removed again
