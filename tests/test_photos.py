"""Photo folders: what the folder recipe chooses from the data, the decoded cache, and
random-resized crops cut from it at the training size (real folders of CIFAR-10 images
exported as JPEG files at 32 and 224 px)."""
import json
import os

import numpy as np
import pytest
import torch

from speedrun.data.sources.builtin import ArrayDataset
from speedrun.data.sources.cache import cache_key, use_cache
from speedrun.data.sources.choices import PHOTO_SIDE, choose, small_folder_batch
from speedrun.data.pipeline.dataset import open_source
from speedrun.data.sources.folder import folder_splits
from speedrun.data.augment.batch import BatchAugment
from speedrun.data.pipeline.resident import ResidentData
from speedrun.errors import RecipeError
from speedrun.recipe import load_recipe

from test_cli import speedrun


def test_photos_and_small_images_are_told_apart_by_their_size_only():
    photos = choose(224, 9469, 10, 512)
    assert "photos" in photos.line() and photos.sections["model"]["name"] == "resnet"
    assert photos.sections["optim"]["filters"] == "orthogonal" and "orthogonalised filter updates" in photos.line()
    assert {"data.image_size": 128, "data.eval_size": 160, "data.eval_crop": 1.0}.items() <= photos.values.items()
    small = choose(32, 50_000, 10, 512)
    assert "small images" in small.line() and not small.sections
    assert small.values["data.image_size"] == 32 and "data.batch_size" not in small.values
    # just below and at the threshold; photos smaller than 160 px train at 0.8 of their side
    assert not choose(PHOTO_SIDE - 8, 1000, 10, 512).sections
    edge = choose(PHOTO_SIDE, 1000, 10, 512)
    assert edge.sections and edge.values["data.image_size"] == 80 and edge.values["data.eval_size"] == 96


def test_a_small_folder_gets_a_batch_that_fits_it():
    assert small_folder_batch(200, 512) == 32            # at least 4 steps an epoch
    assert small_folder_batch(50_000, 512) == 512
    assert small_folder_batch(40, 512) == 16             # not below 16 ...
    assert small_folder_batch(10, 512) == 10             # ... nor above the set
    c = choose(32, 200, 10, 512)
    assert c.values["data.batch_size"] == 32 and "batch 32 for 200 training images" in c.line()


def test_the_folder_recipe_chooses_from_two_folders_and_keeps_what_the_user_set(jpeg32, imagenet224):
    recipe, src = open_source(load_recipe("folder"), jpeg32)
    assert recipe.model.name == "speednet" and recipe.data.image_size == 32 and not recipe.data.auto_choices
    assert "small images" in src.choices[0] and recipe.data.batch_size == 128    # 512 images: 4 steps of 128
    sets = ["train.epochs=3", "data.eval_size=144"]
    recipe, src = open_source(load_recipe("folder", sets), imagenet224)
    assert recipe.model.name == "resnet" and recipe.model.variant == "d" and recipe.augment.crop == "random_resized"
    assert recipe.data.image_size == 128 and recipe.data.eval_size == 144 and recipe.train.epochs == 3   # kept
    assert "photos" in src.choices[0] and "kept as set: train.epochs, data.eval_size" in "; ".join(src.choices)
    # every section but data is the imagenette recipe's, down to the ones it leaves at their defaults
    same = load_recipe("imagenette", sets)
    for section in ("augment", "model", "optim", "schedule", "averaging", "eval", "runtime"):
        assert getattr(recipe, section) == getattr(same, section), section
    assert recipe.averaging.kind == "none"                        # not the folder recipe's lookahead
    assert isinstance(src, ArrayDataset) and src.eval_size == (144, 144) and src.image_size == (128, 128)
    assert src.cache["cache_size"] == 144


def test_the_cache_is_made_once_and_made_again_when_a_file_changes(imagenet224, tmp_path):
    import shutil
    folder = tmp_path / "photos"
    shutil.copytree(imagenet224, folder)
    sets = ["data.eval_size=40", "data.image_size=32", f"data.cache_dir={tmp_path / 'cache'}", "data.workers=1"]
    _, first = open_source(load_recipe("imagenette", sets), folder)
    _, again = open_source(load_recipe("imagenette", sets), folder)
    assert first.cache["cache_made_now"] and not again.cache["cache_made_now"]
    assert first.cache["cache"] == again.cache["cache"]
    assert torch.equal(first.test_x, again.test_x) and first.test_x.shape[2:] == (40, 40)
    victim = sorted((folder / "train").rglob("*.jpg"))[0]
    os.utime(victim, ns=(0, 0))                                       # touched: decoded again
    _, changed = open_source(load_recipe("imagenette", sets), folder)
    assert changed.cache["cache_made_now"] and changed.cache["cache"] != first.cache["cache"]
    train, val = folder_splits(folder, 0.0, 0)
    assert cache_key(train, val, 40, 3, "auto", False) != cache_key(train, val, 48, 3, "auto", False)


def test_a_cache_cut_short_or_overwritten_is_decoded_again_before_training(imagenet224, tmp_path):
    """The cache's size and the checksum of its two ends, kept beside it, are checked each time
    it is opened: a truncated or overwritten copy is said and made again, never trained on."""
    sets = ["data.eval_size=40", "data.image_size=32", f"data.cache_dir={tmp_path / 'cache'}", "data.workers=1"]
    said = []
    _, first = open_source(load_recipe("imagenette", sets), imagenet224)
    path = first.cache["cache"]
    whole = open(path, "rb").read()
    train_x, test_x = first.train_x.clone(), first.test_x.clone()      # (the file is mapped: copies, before
    del first                                                           # it is cut under the mapping)
    with open(path, "r+b") as f:                                        # cut short
        f.truncate(len(whole) // 2)
    _, cut = open_source(load_recipe("imagenette", sets), imagenet224, say=said.append)
    assert cut.cache["cache_made_now"] and cut.cache["cache"] == path
    assert any("again: the cached copy holds" in line and "cut short or overwritten" in line for line in said)
    assert torch.equal(cut.test_x, test_x) and torch.equal(cut.train_x, train_x)
    del cut
    with open(path, "r+b") as f:                                        # overwritten in place, same size
        f.seek(len(whole) - 100)
        f.write(bytes(100))
    said.clear()
    _, over = open_source(load_recipe("imagenette", sets), imagenet224, say=said.append)
    assert over.cache["cache_made_now"] and any("checksum does not match" in line for line in said)
    assert torch.equal(over.train_x, train_x)
    _, again = open_source(load_recipe("imagenette", sets), imagenet224)    # intact: used as it is
    assert not again.cache["cache_made_now"]


def test_a_cache_stored_larger_than_the_evaluation_size(imagenet224, tmp_path):
    """data.cache_size keeps more pixels for the random-resized crops; the evaluation images
    are resized to data.eval_size as the cache is opened, as they would have been decoded."""
    sets = ["data.eval_size=40", "data.image_size=32", f"data.cache_dir={tmp_path / 'cache'}", "data.workers=1"]
    _, at_eval = open_source(load_recipe("imagenette", sets), imagenet224)
    _, larger = open_source(load_recipe("imagenette", sets + ["data.cache_size=64"]), imagenet224)
    assert larger.stored_size == (64, 64) and larger.eval_size == (40, 40) and larger.image_size == (32, 32)
    assert larger.cache["cache_size"] == 64 and larger.cache["eval_size"] == 40
    assert at_eval.stored_size == (40, 40) and at_eval.cache["cache_size"] == 40
    # the same test images, through another route to 40 px: within a grey level or two on average
    gap = (larger.test_x.float() - at_eval.test_x.float()).abs().mean().item()
    assert larger.test_x.dtype == torch.uint8 and gap < 3.0, gap
    # crops are drawn inside the 64 px images and come out at the training size
    data = ResidentData(larger, torch.device("cpu"), torch.float32, torch.contiguous_format)
    augment = BatchAugment(load_recipe("imagenette").augment, data.n_train, data.image_size, torch.Generator().manual_seed(0),
                           torch.device("cpu"), data.mean, data.std, input_size=data.stored_size)
    x, _ = next(data.epoch(0, 16, augment, torch.Generator().manual_seed(0)))
    assert x.shape == (16, 3, 32, 32)
    # smaller than what it must give: refused naming the field, nothing decoded
    caches = sorted((tmp_path / "cache").iterdir())
    with pytest.raises(RecipeError, match=r"data.cache_size=36 .* at least 40 px"):
        open_source(load_recipe("imagenette", sets + ["data.cache_size=36"]), imagenet224)
    assert sorted((tmp_path / "cache").iterdir()) == caches


def test_when_the_cache_is_used():
    assert use_cache("auto", "random_resized", 1.0, 13_394, 3, 160, memory=24 << 30)[0]
    too_big, why = use_cache("auto", "random_resized", 1.0, 1_281_167, 3, 224, memory=24 << 30)
    assert not too_big and "over half" in why
    assert not use_cache("auto", "translate", 1.0, 1000, 3, 32)[0]
    assert not use_cache("auto", "random_resized", 0.875, 1000, 3, 224)[0]       # centre crops: streamed
    assert use_cache("on", "translate", 0.875, 1000, 3, 32)[0] and not use_cache("off", "random_resized", 1.0, 10, 3, 8)[0]
    # asked for, the cache is used with centre crops too, and the start line says what that means
    on, why = use_cache("on", "random_resized", 0.875, 1000, 3, 224)
    assert on and "data.eval_crop=0.875 does not apply" in why
    assert "eval_crop" not in use_cache("on", "random_resized", 1.0, 1000, 3, 224)[1]


def test_random_resized_crops_are_cut_from_the_stored_images_at_the_training_size():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (64, 3, 40, 40), dtype=torch.uint8, generator=g)
    y = torch.arange(64) % 10
    ds = ArrayDataset("t", [str(i) for i in range(10)], x, y, x[:8], y[:8], "t", train_size=32)
    data = ResidentData(ds, torch.device("cpu"), torch.float32, torch.contiguous_format)
    assert data.image_size == (32, 32) and data.stored_size == (40, 40)
    cfg = load_recipe("imagenette").augment.model_copy(update={"flip": "none", "rrc_scale": (1.0, 1.0),
                                                               "rrc_ratio": (1.0, 1.0)})
    aug = BatchAugment(cfg, 64, data.image_size, g, torch.device("cpu"), data.mean, data.std,
                       input_size=data.stored_size)
    boxes = aug.draw(0)["boxes"]
    assert (boxes == torch.tensor([0, 0, 40, 40])).all()              # the whole 40 px image, not 32 px of it
    batch, _ = next(data.epoch(0, 16, aug, g, size=24))
    assert batch.shape[1:] == (3, 24, 24)                             # cut straight at the epoch's size
    # a whole-image box resampled to 24 px is the image resized (bilinear)
    some = data.normalise(x[:16])
    out = aug(some, torch.arange(16), aug.draw(0), 24)
    ref = torch.nn.functional.interpolate(some, size=(24, 24), mode="bilinear", align_corners=False)
    assert torch.allclose(out, ref, atol=1e-4)


def test_folder_run_says_what_it_chose_and_records_it(imagenet224, tmp_path):
    out = tmp_path / "run"
    proc = speedrun("train", "folder", "--data-dir", imagenet224, "--out", out,
                    "--set", "model={name='resnet', depth=18, stem='imagenet', variant='d', width=8, zero_gamma=true}",
                    "--set", "data.image_size=32", "--set", "data.eval_size=40", "--set", "train.epochs=1",
                    "--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "data.workers=1")
    assert "from the data: photos (median shorter side 224 px" in proc.stdout
    assert "decoded once at 40 px" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["data_choices"][0].startswith("photos") and summary["data_cache"]["cache_size"] == 40
    pre = json.loads((out / "preprocessing.json").read_text())
    assert pre["image_size"] == [40, 40] and pre["eval_crop"] == 1.0         # predict sees what evaluation saw
    config = load_recipe(str(out / "config.toml"))
    assert config.model.name == "resnet" and config.model.width == 8 and not config.data.auto_choices


def test_awkward_photos_are_decoded_once_and_a_corrupt_one_is_named_or_skipped(imagenet224, tmp_path):
    import shutil
    from PIL import Image
    folder = tmp_path / "photos"
    shutil.copytree(imagenet224, folder)
    cls = folder / "train" / sorted(p.name for p in (folder / "train").iterdir())[0]
    rgb = np.random.default_rng(0).integers(0, 256, (180, 240, 3), dtype=np.uint8)
    Image.fromarray(rgb).convert("CMYK").save(cls / "cmyk.jpg", quality=90)
    Image.fromarray(rgb[:, :, 0]).save(cls / "grey.png")
    Image.fromarray((rgb[:, :, 1].astype(np.uint16) * 257)).save(cls / "deep.png")         # 16-bit grey
    Image.fromarray(rgb[:3, :3]).save(cls / "tiny.png")
    (cls / "broken.jpg").write_bytes((cls / "cmyk.jpg").read_bytes()[:200])                # truncated
    cache = tmp_path / "cache"
    sets = ["--set", "model={name='resnet', depth=18, stem='imagenet', variant='d', width=8, zero_gamma=true}",
            "--set", "data.image_size=32", "--set", "data.eval_size=40", "--set", "train.epochs=1",
            "--set", f"data.cache_dir={cache}", "--set", "data.workers=1"]
    proc = speedrun("train", "folder", "--data-dir", folder, "--out", tmp_path / "a", *sets, check=False)
    assert proc.returncode == 1 and "broken.jpg" in proc.stderr and "skip_corrupt" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "a").exists()
    assert not list(cache.glob("*.npz")) if cache.exists() else True                     # nothing half-made
    proc = speedrun("train", "folder", "--data-dir", folder, "--out", tmp_path / "b", *sets,
                    "--set", "data.skip_corrupt=true")
    summary = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summary["skipped_images"] == 1 and "unreadable images skipped" in proc.stdout
    # named, from the decoded cache's record: in summary.json and once at the end
    assert [e["path"] for e in summary["skipped_files"]] == [str(cls / "broken.jpg")]
    assert f"speedrun: skipped 1 unreadable image (data.skip_corrupt): {cls / 'broken.jpg'} (" in proc.stdout


def _pillow_folder(root, side: int, ext: str, n_train: int = 12, n_val: int = 4):
    """A small folder of real image files made with Pillow: two classes (a light and a dark
    pattern with noise), train/ and val/."""
    from PIL import Image
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("val", n_val)):
        for k, cls in enumerate(("light", "dark")):
            (root / split / cls).mkdir(parents=True)
            for i in range(n):
                base = 190 if k == 0 else 60
                pixels = np.clip(base + rng.normal(0, 30, (side, side + 16, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(root / split / cls / f"{i}.{ext}")
    return root


def test_model_fields_are_set_on_the_model_the_data_chose(tmp_path, cli):
    """--set values under model. are applied once, to the model the data chose: photos' ResNet
    takes model.width, small images' speed net model.widths; a field the chosen model lacks is
    refused naming what the data chose and the fields that model has."""
    from test_failures import check_refused
    photos = _pillow_folder(tmp_path / "photos", 112, "jpg")
    small = _pillow_folder(tmp_path / "small", 32, "png")
    err = check_refused(cli("train", "folder", "--data-dir", photos, "--set", "model.widths=[16,32,32]",
                            "--out", tmp_path / "a"), 2, "unknown recipe field 'model.widths'; did you mean "
                        "'model.width'?", "photos (median shorter side 112 px", "depth", "variant", "zero_gamma",
                        "error: --set model.widths=[16,32,32] over folder with what the data chose (photos")
    assert "fields here: " in err
    err = check_refused(cli("train", "folder", "--data-dir", small, "--set", "model.width=16",
                            "--out", tmp_path / "b"), 2, "unknown recipe field 'model.width'; did you mean "
                        "'model.widths'?", "small images (median shorter side 32 px", "whiten")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

    out = tmp_path / "run"
    proc = speedrun("train", "folder", "--data-dir", photos, "--set", "model.width=8", "--set", "train.epochs=1",
                    "--set", "data.workers=1", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--out", out)
    assert "from the data: photos" in proc.stdout and "kept as set: model.width" in proc.stdout
    config = load_recipe(str(out / "config.toml"))
    assert config.model.name == "resnet" and config.model.width == 8 and config.model.variant == "d"
    out = tmp_path / "run-small"
    speedrun("train", "folder", "--data-dir", small, "--set", "model.widths=[8,8,8]", "--set", "train.epochs=1",
             "--set", "data.workers=1", "--out", out)
    config = load_recipe(str(out / "config.toml"))
    assert config.model.name == "speednet" and config.model.widths == [8, 8, 8]
