"""``data prepare --decoder torchvision``: JPEGs decoded in batches by torchvision on the device
(nvjpeg on a GPU; the same calls decode on the CPU here), on real CIFAR-10 images upscaled to
non-square photos. The tests that decode need torchvision and are skipped, saying why, where
it cannot be imported (the CPU torch 2.13 in .venv); CI runs them in .venv-2.14 beside
torchvision 0.29.1. Where it cannot be imported, asking for it is one clear error."""
import pytest
import torch
from PIL import Image

from speedrun.data import DataError
from speedrun.data.sources.arrays import load_npz
from speedrun.data.sources.folder import folder_splits
from speedrun.data.prepare import prepare
from speedrun.data.pipeline.stream import Decoding, ImageItems

from test_failures import assert_unchanged, check_refused, snapshot


def _torchvision_missing() -> str | None:
    try:
        import torchvision.io  # noqa: F401
    except Exception as err:                        # noqa: BLE001 - a mismatched build fails in many ways
        return f"torchvision cannot be imported here ({type(err).__name__}: {err})"
    return None


MISSING = _torchvision_missing()
needs_torchvision = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

SHAPES = [(64, 64), (96, 72), (72, 96), (80, 64), (91, 64), (64, 95), (96, 96)]
"""(width, height) of the photos: square, landscape, portrait, sides differing by odd counts."""


@pytest.fixture(scope="module")
def photos(tmp_path_factory, cifar10):
    """CIFAR-10's first 70 training and 21 test images upscaled (bicubic) to 64-96 px, most
    square-less, as JPEG (quality 90; every tenth as PNG) in the ImageNet layout."""
    root = tmp_path_factory.mktemp("photos") / "photos"
    for split, xs, ys, n in (("train", cifar10.train_x, cifar10.train_y, 70),
                             ("val", cifar10.test_x, cifar10.test_y, 21)):
        for i in range(n):
            w, h = SHAPES[i % len(SHAPES)]
            folder = root / split / cifar10.classes[int(ys[i])]
            folder.mkdir(parents=True, exist_ok=True)
            im = Image.fromarray(xs[i].permute(1, 2, 0).numpy()).resize((w, h), Image.BICUBIC)
            if i % 10 == 9:
                im.save(folder / f"{i:03d}.png")
            else:
                im.save(folder / f"{i:03d}.jpg", quality=90)
    return root


def reference(images, size: int, channels: int, decoder: str) -> torch.Tensor:
    """The streamed pipeline's centre crop (fraction 1.0), N x C x size x size."""
    items = ImageItems(images, Decoding(channels, False, eval_crop=1.0, decoder=decoder))
    return torch.stack([items[(i, size, 0)][0] for i in range(len(images))]).permute(0, 3, 1, 2)


def differences(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(mean absolute difference in grey levels, the largest of the per-image means)."""
    d = (a.float() - b.float()).abs()
    return float(d.mean()), float(d.mean(dim=(1, 2, 3)).max())


@pytest.mark.skipif(MISSING is None, reason="torchvision can be imported here")
def test_asking_for_torchvision_without_it_is_one_clear_error_and_writes_nothing(photos, tmp_path, cli):
    before = snapshot(tmp_path)
    with pytest.raises(DataError, match=r"decoder 'torchvision' needs torchvision.*install the torchvision "
                                        r"release built for this torch"):
        prepare(photos, 32, tmp_path / "new" / "x.npz", decoder="torchvision")
    err = check_refused(cli("data", "prepare", photos, "--size", 32, "--out", tmp_path / "y.npz",
                            "--decoder", "torchvision"), 1, "torchvision", f"torch {torch.__version__}")
    assert "decoder 'auto'" in err
    # training streamed through it: refused the same way before the run folder is made
    err = check_refused(cli("train", "folder", "--data-dir", photos, "--out", tmp_path / "run", "--set",
                            "data.decoder=torchvision", "--set", "data.cache=off"), 1, "torchvision")
    assert "decoder 'auto'" in err
    assert_unchanged(tmp_path, before)


@needs_torchvision
def test_torchvision_decoding_matches_the_pillow_path(photos):
    from speedrun.data.sources.device_decode import decode_to_square
    train, _ = folder_splits(photos, 0.0, 0)
    paths = [train.path(i) for i in range(len(train))]
    assert {p.suffix for p in paths} == {".jpg", ".png"}
    for channels in (3, 1):
        for size in (32, 64):
            x, kept = decode_to_square(paths, size, channels, torch.device("cpu"), False)
            assert x.shape == (len(paths), channels, size, size) and x.dtype == torch.uint8 and bool(kept.all())
            # the default decoder (libjpeg-turbo, fast DCT, DCT down-scaling first): close
            mean, worst = differences(x, reference(train, size, channels, "auto"))
            assert mean < 3 and worst < 6, (channels, size, mean, worst)
            if size == 64:
                # Pillow without DCT down-scaling (no photo is 128 px or more): the same geometry and
                # filter, so only the decoders' and the fixed-point rounding remain
                mean, worst = differences(x, reference(train, size, channels, "pillow"))
                assert mean < 0.5 and worst < 1, (channels, mean, worst)


@needs_torchvision
def test_a_corrupt_jpeg_is_named_or_skipped_by_the_torchvision_decoder(photos, tmp_path):
    from speedrun.data.sources.device_decode import decode_to_square
    good = sorted((photos / "train" / "cat").glob("*.jpg"))[:3]
    data = good[0].read_bytes()
    truncated = tmp_path / "truncated.jpg"          # a readable header: fails in the batched decode
    truncated.write_bytes(data[:len(data) // 2])
    junk = tmp_path / "junk.jpg"                    # not a JPEG at all: fails on the host
    junk.write_bytes(b"not an image at all")
    cpu = torch.device("cpu")
    for bad in (truncated, junk):
        with pytest.raises(DataError, match=rf"{bad.name}: cannot decode this image.*--skip-corrupt"):
            decode_to_square([good[0], bad, good[1]], 32, 3, cpu, False)
    x, kept = decode_to_square([good[0], truncated, good[1], junk, good[2]], 32, 3, cpu, True)
    assert kept.tolist() == [True, False, True, False, True]
    clean, _ = decode_to_square(good, 32, 3, cpu, False)
    assert torch.equal(x[kept], clean) and not x[~kept].any()


@needs_torchvision
def test_prepare_with_the_torchvision_decoder_writes_the_npz_the_default_decoder_writes(photos, tmp_path, cli):
    rc, err = cli("data", "prepare", photos, "--size", 32, "--out", tmp_path / "tv.npz", "--decoder", "torchvision")
    assert rc == 0, err
    prepare(photos, 32, tmp_path / "default.npz", workers=1)
    tv, default = load_npz(tmp_path / "tv.npz"), load_npz(tmp_path / "default.npz")
    assert tv.classes == default.classes
    assert torch.equal(tv.train_y, default.train_y) and torch.equal(tv.test_y, default.test_y)
    for a, b in ((tv.train_x, default.train_x), (tv.test_x, default.test_x)):
        mean, worst = differences(a, b)
        assert a.shape == b.shape and mean < 3 and worst < 6, (mean, worst)


@needs_torchvision
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nvjpeg)")
def test_nvjpeg_on_the_gpu_decodes_what_the_cpu_decodes(photos):
    from speedrun.data.sources.device_decode import decode_to_square
    train, _ = folder_splits(photos, 0.0, 0)
    paths = [train.path(i) for i in range(len(train))]
    gpu, kept = decode_to_square(paths, 32, 3, torch.device("cuda"), False)
    cpu, _ = decode_to_square(paths, 32, 3, torch.device("cpu"), False)
    assert gpu.device.type == "cuda" and bool(kept.all())
    mean, worst = differences(gpu.cpu(), cpu)
    assert mean < 1 and worst < 3, (mean, worst)
    # streamed lists: pinned bytes in, pinned squares out, handed on one list behind
    from speedrun.data.sources.device_decode import SquareDecoder
    lists = list(SquareDecoder(32, 3, "cuda").stream(paths, 16))
    streamed = torch.cat([x for _, x, _ in lists])
    assert all(x.is_pinned() for _, x, _ in lists) and torch.equal(streamed, gpu.cpu())


@pytest.fixture(scope="module")
def mixed_files(photos, tmp_path_factory):
    """The photos' training files plus progressive JPEGs and PNGs made from some of them: every
    kind of file the reading threads hand on (baseline JPEG bytes, host-decoded images)."""
    train, _ = folder_splits(photos, 0.0, 0)
    paths = [train.path(i) for i in range(len(train))]
    extra = tmp_path_factory.mktemp("mixed")
    for i, p in enumerate([p for p in paths if p.suffix == ".jpg"][:6]):
        with Image.open(p) as im:
            im.save(extra / f"progressive-{i}.jpg", quality=90, progressive=True)
    return paths + sorted(extra.glob("*.jpg"))


@needs_torchvision
def test_lists_decoded_in_overlapped_batches_equal_each_file_decoded_alone(mixed_files):
    """The batched decoder (files read by threads, one decode call per list, images of one shape
    resized together, lists handed on one behind) gives, file for file and in order, exactly
    the square the per-image path gives (one decode call, one image resized): equal on the CPU,
    where both run the same libjpeg-turbo and the same float32 products."""
    from speedrun.data.sources.device_decode import SquareDecoder, decode_one
    assert len({tuple(Image.open(p).size) for p in mixed_files}) >= 5
    for channels, size, per_list in ((3, 40, 16), (1, 64, 7), (3, 64, 1000)):
        decoder = SquareDecoder(size, channels, "cpu", threads=3)
        lists = list(decoder.stream(mixed_files, per_list))
        assert [start for start, _, _ in lists] == list(range(0, len(mixed_files), per_list))
        assert all(bool(kept.all()) for _, _, kept in lists)
        batched = torch.cat([x for _, x, _ in lists])
        alone = torch.stack([decode_one(p, size, channels) for p in mixed_files])
        assert batched.shape == (len(mixed_files), channels, size, size)
        assert torch.equal(batched, alone), (channels, size, (batched.int() - alone.int()).abs().max())


@needs_torchvision
def test_progressive_jpegs_are_decoded_on_the_host_as_torchvision_decodes_them(mixed_files):
    """A progressive JPEG goes to the host threads (nvJPEG decodes those one at a time): the
    header says so, and Pillow's accurate-DCT libjpeg gives what torchvision's decoder gives."""
    import warnings
    from torchvision import io as tvio
    from speedrun.data.sources.device_decode import _check_header, _read
    progressive = [p for p in mixed_files if p.name.startswith("progressive")]
    baseline = [p for p in mixed_files if p.suffix == ".jpg" and not p.name.startswith("progressive")]
    assert progressive and baseline
    assert not any(_check_header(p.read_bytes(), p) for p in baseline)
    for p in progressive:
        assert _check_header(p.read_bytes(), p)
        r = _read(p, 3)
        assert r.jpeg is None and r.error is None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            theirs = tvio.decode_jpeg(tvio.read_file(str(p)), mode=tvio.ImageReadMode.RGB)
        assert r.image.shape == theirs.shape
        assert (r.image.float() - theirs.float()).abs().mean() < 1


@needs_torchvision
def test_a_corrupt_file_in_a_later_list_is_named_or_skipped_in_place(mixed_files, tmp_path):
    """Streamed lists keep their files' places when one is skipped, and an unreadable file
    stops the stream with its name; the reading threads are stopped with it."""
    from speedrun.data.sources.device_decode import SquareDecoder
    data = mixed_files[0].read_bytes()
    truncated = tmp_path / "truncated.jpg"
    truncated.write_bytes(data[:len(data) // 2])
    files = mixed_files[:20] + [truncated] + mixed_files[20:30]
    with pytest.raises(DataError, match=r"truncated\.jpg: cannot decode this image"):
        list(SquareDecoder(32, 3, "cpu").stream(files, 8))
    lists = list(SquareDecoder(32, 3, "cpu", skip_corrupt=True).stream(files, 8))
    kept = torch.cat([k for _, _, k in lists])
    assert kept.tolist() == [True] * 20 + [False] + [True] * 10
    x = torch.cat([x for _, x, _ in lists])
    clean = torch.cat([x for _, x, _ in SquareDecoder(32, 3, "cpu").stream(files[:20] + files[21:], 8)])
    assert not x[20].any() and torch.equal(x[kept], clean)


@needs_torchvision
def test_the_batch_decode_benchmark_times_whole_passes_and_each_phase(tmp_path):
    """benchmarks/batch_decode.py on 20 photos: a complete record naming the device, the code and
    where the time goes (the phases cover every training file; a list's distinct shapes counted)."""
    import json
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "batch_decode.py"), "--work", str(tmp_path / "w"),
                           "--images", "20", "--size", "48", "--batch", "8", "--rounds", "2", "--write-images", "300",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["photos"]["train"] == 20 and record["photos"]["val"] == 10 and record["size"] == 48
    assert record["photos"]["mean_bytes"] > 5000            # photo-like, not flat colour
    assert len(record["whole_images_per_s"]) == 2 and record["median_whole_images_per_s"] > 0
    phases = record["phases"]
    assert set(phases["seconds"]) == {"read", "header", "decode", "resize"} and all(
        s > 0 for s in phases["seconds"].values())
    assert len(phases["distinct_shapes_per_list"]) == 3 and max(phases["distinct_shapes_per_list"]) >= 2
    assert record["torch_version"] == torch.__version__ and record["device"] and record["machine"]["cpu_model"]
    writes = record["writes"]
    assert writes["images"] == 300 and writes["gigabytes"] == pytest.approx(300 * 3 * 224 * 224 / 1e9)
    assert writes["scratch_gb_per_s"] > 0 and writes["npz_member_gb_per_s"] > 0
    assert not list((tmp_path / "w").glob("writes*"))          # (the timed files removed)
    rc = subprocess.run([sys.executable, str(root / "benchmarks" / "batch_decode.py"), "--work", str(tmp_path / "w"),
                         "--images", "20", "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=root)
    assert rc.returncode == 1 and "batch_decode.py:" in rc.stderr and "Traceback" not in rc.stderr   # kept record


def _pipeline(folder, decoder: str, *extra: str):
    from speedrun.data.pipeline.dataset import open_pipeline, open_source
    from speedrun.engine.runtime import resolve_runtime
    from speedrun.recipe import load_recipe
    sets = [f"data.path={folder}", "data.cache=off", "data.workers=0", "data.image_size=48", "data.eval_size=56",
            "data.batch_size=16", "eval.batch_size=10", "augment.crop=random_resized", "augment.rrc_scale=[0.35,1.0]",
            f"data.decoder={decoder}", *extra]
    recipe, source = open_source(load_recipe("folder", sets))
    return open_pipeline(source, recipe, resolve_runtime(recipe.runtime, torch.device("cpu")), seed=3)


@needs_torchvision
def test_the_device_streamed_pipeline_cuts_the_crops_the_worker_processes_cut(photos):
    """data.decoder=torchvision with data.cache=off: each batch decoded and cropped on the device
    (here the CPU) holds the images the worker-decoded pipeline's batch holds, in its order, with
    the same random-resized boxes (drawn from the image's own random stream) and the same centre
    crops for evaluation: on photos too small for DCT down-scaling, Pillow's fixed-point filter
    against float32 products, under one grey level apart on average. The crops of a batch,
    padded onto one canvas, equal each crop cut alone."""
    from speedrun.data.pipeline.device_stream import DeviceStreamedData
    from speedrun.data.sources.device_decode import crops_of
    workers, device = _pipeline(photos, "pillow"), _pipeline(photos, "torchvision")
    assert isinstance(device, DeviceStreamedData) and not isinstance(workers, DeviceStreamedData)
    for data in (workers, device):
        data.train_sampler.set_epoch(2, 48)
    for train_batches in ((workers.train_loader, device.train_loader), (workers.val_loader, device.val_loader)):
        pairs = list(zip(workers._decoded(train_batches[0]), device._decoded(train_batches[1])))
        assert len(pairs) == len(train_batches[0].batch_sampler) >= 2
        for (xa, ya, ia, sa), (xb, yb, ib, sb) in pairs:
            assert torch.equal(ya, yb) and torch.equal(ia, ib) and sa == sb == []
            assert xa.shape == xb.shape and xb.is_contiguous(memory_format=torch.channels_last)
            mean, worst = differences(xa, xb)
            assert mean < 1 and worst < 1.5, (mean, worst)
    # another epoch draws other boxes, on both paths alike
    device.train_sampler.set_epoch(3, 48)
    again = next(iter(device._decoded(device.train_loader)))
    device.train_sampler.set_epoch(2, 48)
    first = next(iter(device._decoded(device.train_loader)))
    assert not torch.equal(again[0], first[0])
    # the canvas: a batch's crops equal each one cut alone
    imgs = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in ((40, 70), (90, 33), (64, 64), (17, 25))]
    boxes = [(3.0, 10.5, 30.0, 41.0), (0.0, 0.0, 90.0, 33.0), (7.25, 2.0, 20.0, 60.0), (1.0, 1.0, 15.0, 20.0)]
    together = crops_of(imgs, boxes, 24)
    alone = torch.cat([crops_of([im], [box], 24) for im, box in zip(imgs, boxes)])
    assert (together.int() - alone.int()).abs().max() <= 1
    assert (together != alone).float().mean() < 0.01


@needs_torchvision
def test_the_device_streamed_pipeline_names_or_skips_an_unreadable_image(photos, tmp_path):
    import shutil
    copy = tmp_path / "photos"
    shutil.copytree(photos, copy)
    victim = sorted((copy / "train").rglob("*.jpg"))[5]
    victim.write_bytes(victim.read_bytes()[:200])
    data = _pipeline(copy, "torchvision")
    data.train_sampler.set_epoch(0, 48)
    with pytest.raises(DataError, match=rf"{victim.name}: cannot decode this image"):
        list(data._decoded(data.train_loader))
    data = _pipeline(copy, "torchvision", "data.skip_corrupt=true")
    data.train_sampler.set_epoch(0, 48)
    batches = list(data._decoded(data.train_loader))
    skipped = [s for _, _, _, ss in batches for s in ss]
    assert [s.path for s in skipped] == [str(victim)] and "cannot decode" in skipped[0].reason
    assert sum(len(y) for _, y, _, _ in batches) == 16 * len(batches) - 1


@needs_torchvision
def test_a_folder_trains_streamed_through_the_device_decoder(jpeg32, tmp_path):
    """speedrun train folder --set data.decoder=torchvision --set data.cache=off: every epoch's
    batches decoded and cropped on the device; the model learns (32 steps on 512 CIFAR-10
    images: chance is 10%, its std 1.3 points on 512 test images)."""
    import json
    from small_data import speedrun
    out = tmp_path / "run"
    proc = speedrun("train", "folder", "--data-dir", jpeg32, "--out", out, "--set", "train.epochs=16",
                    "--set", "model.widths=[16,32,32]", "--set", "data.batch_size=256", "--set", "eval.every=0",
                    "--set", "data.decoder=torchvision", "--set", "data.cache=off")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["test_acc"] > 0.18, summary["test_acc"]
    assert "streamed (data.cache=off); each batch decoded and cropped on the run's device by torchvision" in proc.stdout


@needs_torchvision
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (nvjpeg)")
def test_the_device_streamed_pipeline_on_the_gpu_cuts_what_it_cuts_on_the_cpu(photos):
    from speedrun.data.pipeline.dataset import open_pipeline, open_source
    from speedrun.engine.runtime import resolve_runtime
    from speedrun.recipe import load_recipe
    sets = [f"data.path={photos}", "data.cache=off", "data.image_size=48", "data.batch_size=16",
            "augment.crop=random_resized", "data.decoder=torchvision"]
    recipe, source = open_source(load_recipe("folder", sets))
    batches = {}
    for device in ("cpu", "cuda"):
        data = open_pipeline(source, recipe, resolve_runtime(recipe.runtime, torch.device(device)), seed=1)
        data.train_sampler.set_epoch(1, 48)
        batches[device] = list(data._decoded(data.train_loader))
    for (xa, ya, _, _), (xb, yb, _, _) in zip(batches["cpu"], batches["cuda"]):
        assert xb.device.type == "cuda" and torch.equal(ya, yb)
        mean, worst = differences(xa, xb.cpu())
        assert mean < 1 and worst < 3, (mean, worst)


@needs_torchvision
def test_a_device_streamed_run_signalled_mid_epoch_stops_and_resumes_bit_for_bit(jpeg32, tmp_path):
    """The device-decoded stream under the stop signals a terminal and SLURM send (to the whole
    process group, in the middle of an epoch, while the reading threads fetch the next batch):
    the run checkpoints at the step boundary, exits resumable without a traceback, and resumed
    twice ends with the uninterrupted run's weights, every tensor."""
    import signal
    import subprocess
    import sys
    from test_stop_signals import STREAMED, cut_and_resume, equal_weights, plain_env
    args = [*STREAMED, "--data-dir", str(jpeg32), "--set", "train.epochs=2", "--set", "data.decoder=torchvision",
            "--set", "data.cache=off"]
    cmd = [sys.executable, "-m", "speedrun", "train"]
    whole = subprocess.Popen([*cmd, *args, "--out", str(tmp_path / "whole")], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=plain_env())
    run = tmp_path / "cut"
    stops = cut_and_resume([*cmd, *args, "--log-every", "1", "--out", str(run)],
                           [*cmd, "--resume", str(run), "--data-dir", str(jpeg32), "--log-every", "1"],
                           [(signal.SIGINT, 3, 0), (signal.SIGTERM, 10, 0)], 16)
    assert stops == sorted(stops)
    assert whole.wait(timeout=300) == 0, whole.stderr.read()
    assert equal_weights(tmp_path / "whole", run)


@needs_torchvision
def test_two_processes_streamed_through_the_device_decoder_train_what_one_trains(jpeg32, tmp_path):
    """torchrun, gloo, two processes: each decodes and crops its own share of every batch on its
    device (the same sampler shards as the worker-decoded stream); with batch norm synchronised
    and fp32 they end with one process's weights, and every test image is counted once."""
    from test_distributed import ok, relative_difference, run, single, summary, torchrun_cmd, weights
    common = ["folder", "--data-dir", jpeg32, "--device", "cpu", "--set", "model.widths=[8,16,16]",
              "--set", "data.batch_size=128", "--set", "train.epochs=1", "--set", "runtime.precision=fp32",
              "--set", "eval.tta=flip", "--set", "eval.tta_fraction=1.0", "--set", "model.norm.sync_ranks=0",
              "--set", "data.decoder=torchvision", "--set", "data.cache=off"]
    ok(single(*common, "--out", tmp_path / "one"))
    ok(run(torchrun_cmd(*common, "--out", tmp_path / "two")))
    one, two = summary(tmp_path / "one"), summary(tmp_path / "two")
    assert (one["world_size"], two["world_size"]) == (1, 2) and one["steps"] == two["steps"] == 4
    assert relative_difference(weights(tmp_path / "one"), weights(tmp_path / "two")) < 1e-5
    assert one["test_acc"] == pytest.approx(two["test_acc"], abs=1 / 512 + 1e-9)
