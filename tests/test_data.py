import gzip
import http.server
import io
import os
import platform
import shutil
import socket
import tarfile
import threading
from pathlib import Path

import pytest
import torch

from speedrun.data import DataError, load_dataset
from speedrun.data.sources import download
from speedrun.data.sources.download import md5sum, safe_extract
from speedrun.data.sources.builtin import CIFAR10, FASHION_MNIST, parse_idx, verify_files


# ---------------------------------------------------------------------------- the real data
def test_shared_cifar10_has_official_checksums(data_dir):
    folder = data_dir / "cifar-10-batches-py"
    official = {line.split()[1].split("/")[-1]: line.split()[0]
                for line in (data_dir / "MD5SUMS").read_text().splitlines() if "cifar" in line}
    for f in CIFAR10.files:
        assert f.md5 == official[f.name]
        assert md5sum(folder / f.name) == f.md5
    verify_files(CIFAR10, folder)


def test_cifar10_counts_shapes_and_classes(cifar10):
    assert cifar10.train_x.shape == (50_000, 3, 32, 32) and cifar10.train_x.dtype == torch.uint8
    assert cifar10.test_x.shape == (10_000, 3, 32, 32)
    assert torch.bincount(cifar10.train_y).tolist() == [5000] * 10
    assert torch.bincount(cifar10.test_y).tolist() == [1000] * 10
    assert cifar10.classes[0] == "airplane" and cifar10.classes[-1] == "truck"


def test_fashion_mnist_counts_and_content_checksums(fashion):
    assert fashion.train_x.shape == (60_000, 1, 28, 28)
    assert fashion.test_x.shape == (10_000, 1, 28, 28)
    assert torch.bincount(fashion.train_y).tolist() == [6000] * 10
    assert torch.bincount(fashion.test_y).tolist() == [1000] * 10


# ------------------------------------------------------------------------------ bad files
def _copy_set(src: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for f in src.iterdir():
        (dest / f.name).symlink_to(f)
    return dest


def _real_copy(folder: Path, name: str) -> Path:
    path = folder / name
    target = path.resolve()
    path.unlink()
    shutil.copyfile(target, path)
    return path


def test_truncated_file_is_named(data_dir, tmp_path, isolated_env):
    folder = _copy_set(data_dir / "cifar-10-batches-py", tmp_path / "d" / "cifar-10-batches-py")
    path = _real_copy(folder, "data_batch_3")
    with open(path, "r+b") as f:
        f.truncate(1_000_000)
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", tmp_path / "d", fetch=False)
    msg = str(err.value)
    assert "data_batch_3" in msg and "truncated" in msg and "1000000 bytes" in msg and "Delete" in msg


def test_wrong_checksum_is_named(data_dir, tmp_path, isolated_env):
    folder = _copy_set(data_dir / "cifar-10-batches-py", tmp_path / "d" / "cifar-10-batches-py")
    path = _real_copy(folder, "test_batch")
    with open(path, "r+b") as f:
        f.seek(5_000_000)
        byte = f.read(1)
        f.seek(5_000_000)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(DataError, match=r"test_batch: checksum mismatch"):
        load_dataset("cifar10", tmp_path / "d", fetch=False)


def test_truncated_gzip_is_named(data_dir, tmp_path, isolated_env):
    folder = _copy_set(data_dir / "fashion-mnist", tmp_path / "d" / "fashion-mnist")
    path = _real_copy(folder, "train-labels-idx1-ubyte.gz")
    path.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(DataError, match="train-labels-idx1-ubyte.gz: not a complete gzip file"):
        load_dataset("fashion-mnist", tmp_path / "d", fetch=False)


def test_a_missing_file_of_a_set_is_named(data_dir, tmp_path, isolated_env):
    folder = _copy_set(data_dir / "cifar-10-batches-py", tmp_path / "d" / "cifar-10-batches-py")
    (folder / "data_batch_5").unlink()
    with pytest.raises(DataError, match="data_batch_5: missing"):
        load_dataset("cifar10", tmp_path / "d", fetch=False)


def test_idx_header_must_match_content():
    with pytest.raises(DataError, match="not an idx file"):
        parse_idx(b"PK\x03\x04....", "x.gz")
    header = b"\x00\x00\x08\x01" + (10).to_bytes(4, "big")
    with pytest.raises(DataError, match="holds 3 values, its header says"):
        parse_idx(header + b"abc", "labels.gz")
    assert parse_idx(header + bytes(range(10)), "ok").tolist() == list(range(10))


# ----------------------------------------------------------------- missing data, download
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_missing_data_lists_where_it_looked(tmp_path, isolated_env, monkeypatch):
    monkeypatch.setenv("SPEEDRUN_MIRROR", f"http://127.0.0.1:{_closed_port()}/")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", empty)
    msg = str(err.value)
    assert "dataset 'cifar10' not found" in msg
    assert str(empty / "cifar-10-batches-py") in msg and "cifar-10-python.tar.gz" in msg
    assert str(Path(os.environ["HOME"]) / ".cache" / "speedrun") in msg
    assert "download failed" in msg and "--data-dir" in msg and "SPEEDRUN_DATA" in msg
    assert list(empty.iterdir()) == []          # nothing half-written left behind


class _Server:
    """A real HTTP server on loopback serving one folder."""

    def __init__(self, folder: Path):
        handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(folder), **k)
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.RequestHandlerClass.log_message = lambda *a: None
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []
    def start(folder):
        servers.append(_Server(folder))
        return servers[-1].url
    yield start
    for s in servers:
        s.close()


def test_download_fashion_mnist_from_a_server(data_dir, tmp_path, isolated_env, monkeypatch, serve):
    monkeypatch.setenv("SPEEDRUN_MIRROR", serve(data_dir / "fashion-mnist"))
    dest = tmp_path / "data"
    ds = load_dataset("fashion-mnist", dest)
    assert ds.train_x.shape == (60_000, 1, 28, 28)
    assert sorted(p.name for p in (dest / "fashion-mnist").iterdir()) == sorted(f.name for f in FASHION_MNIST.files)
    assert [p.name for p in dest.iterdir()] == ["fashion-mnist"]      # no staging leftovers


def test_download_cifar10_archive_extracts_and_verifies(cifar_archive, tmp_path, isolated_env, monkeypatch, serve):
    monkeypatch.setenv("SPEEDRUN_MIRROR", serve(cifar_archive.parent))
    dest = tmp_path / "data"
    ds = load_dataset("cifar10", dest)
    assert ds.train_x.shape == (50_000, 3, 32, 32)
    assert (dest / "cifar-10-python.tar.gz").is_file()
    assert md5sum(dest / "cifar-10-batches-py" / "data_batch_1") == CIFAR10.files[0].md5
    # the next load finds the extracted folder without the network
    monkeypatch.setenv("SPEEDRUN_MIRROR", f"http://127.0.0.1:{_closed_port()}/")
    assert load_dataset("cifar10", dest).test_x.shape == (10_000, 3, 32, 32)


def test_a_corrupt_member_is_named_by_its_name_in_the_archive(data_dir, tmp_path, isolated_env, monkeypatch,
                                                               serve):
    site = tmp_path / "site"
    site.mkdir()
    served = site / "cifar-10-python.tar.gz"
    with tarfile.open(served, "w:gz", compresslevel=1) as tar:
        for f in sorted((data_dir / "cifar-10-batches-py").iterdir()):
            data = bytearray(f.read_bytes())
            if f.name == "data_batch_2":
                data[1_000_000] ^= 0xFF                 # one byte altered: same size, wrong checksum
            info = tarfile.TarInfo(f"cifar-10-batches-py/{f.name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(bytes(data)))
    monkeypatch.setenv("SPEEDRUN_MIRROR", serve(site))
    dest = tmp_path / "data"
    with pytest.raises(DataError) as err:
        load_dataset("cifar10", dest)
    msg = str(err.value)
    archive = dest / "cifar-10-python.tar.gz"
    assert msg.startswith(f"{archive}: member cifar-10-batches-py/data_batch_2: checksum mismatch"), msg
    assert f"Delete {archive} and let speedrun download it again" in msg
    assert ".cifar-10-batches-py-" not in msg                   # no temporary extraction path
    assert [p.name for p in dest.iterdir()] == ["cifar-10-python.tar.gz"]     # no staging, no partial folder


def test_corrupt_download_leaves_nothing(data_dir, tmp_path, isolated_env, monkeypatch, serve):
    site = tmp_path / "site"
    site.mkdir()
    for f in FASHION_MNIST.files:
        (site / f.name).write_bytes((data_dir / "fashion-mnist" / f.name).read_bytes())
    broken = site / "t10k-labels-idx1-ubyte.gz"
    broken.write_bytes(gzip.compress(b"\x00\x00\x08\x01" + (10_000).to_bytes(4, "big") + bytes(10_000)))
    monkeypatch.setenv("SPEEDRUN_MIRROR", serve(site))
    dest = tmp_path / "data"
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz: checksum mismatch"):
        load_dataset("fashion-mnist", dest)
    assert not dest.exists()                # nor the folder made for the download


# ------------------------------------------------------------------------------ archives
def _tar_with(path: Path, name: str, data: bytes = b"x", symlink_to: str | None = None) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(name)
        if symlink_to:
            info.type, info.linkname = tarfile.SYMTYPE, symlink_to
            tar.addfile(info)
        else:
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(params=["data-filter", "plain"])
def extraction(request, monkeypatch):
    """Both ways an archive is checked: tarfile's 'data' filter (Python 3.11.4 and later) and,
    where Python has none, speedrun's own check of plain files and folders."""
    if request.param == "plain":
        monkeypatch.setattr(download, "data_filter", None)
    elif download.data_filter is None:
        pytest.skip(f"Python {platform.python_version()} has no tarfile data filter (3.11.4 and later have)")
    return request.param


@pytest.mark.parametrize("name,link", [("../evil.txt", None), ("/tmp/evil-abs.txt", None),
                                       ("cifar-10-batches-py/link", "../../outside")])
def test_extraction_refuses_paths_outside_the_target(tmp_path, name, link, extraction):
    archive = _tar_with(tmp_path / "bad.tar.gz", name, symlink_to=link)
    target = tmp_path / "target"
    with pytest.raises(DataError, match="refusing to extract member"):
        safe_extract(archive, target)
    assert not (tmp_path / "evil.txt").exists() and not Path("/tmp/evil-abs.txt").exists()
    assert list(target.iterdir()) == []


def test_extraction_writes_the_files_and_folders_of_a_genuine_archive(tmp_path, extraction):
    archive = tmp_path / "good.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, data in (("set/a.bin", b"first"), ("set/sub/b.bin", b"second")):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o4777                   # (set-uid, writable by all: not kept)
            tar.addfile(info, io.BytesIO(data))
    files = safe_extract(archive, tmp_path / "out")
    assert sorted(p.relative_to(tmp_path / "out").as_posix() for p in files) == ["set/a.bin", "set/sub/b.bin"]
    assert (tmp_path / "out" / "set" / "sub" / "b.bin").read_bytes() == b"second"
    assert not (tmp_path / "out" / "set" / "a.bin").stat().st_mode & 0o4002


def test_archive_found_locally_is_extracted(cifar_archive, tmp_path, isolated_env):
    try:
        os.link(cifar_archive, tmp_path / cifar_archive.name)        # (the shared file is left as it was)
    except OSError:
        shutil.copyfile(cifar_archive, tmp_path / cifar_archive.name)
    ds = load_dataset("cifar10", tmp_path, fetch=False)
    assert len(ds.train_y) == 50_000


def test_truncated_archive_is_named(data_dir, tmp_path, isolated_env):
    archive = tmp_path / "cifar-10-python.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(data_dir / "cifar-10-batches-py" / "data_batch_1", arcname="cifar-10-batches-py/data_batch_1")
    archive.write_bytes(archive.read_bytes()[:3_000_000])
    with pytest.raises(DataError, match="cifar-10-python.tar.gz: cannot read the archive"):
        load_dataset("cifar10", tmp_path, fetch=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar-10-python.tar.gz"]   # no staging left
