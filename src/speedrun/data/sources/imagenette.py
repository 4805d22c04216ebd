"""Imagenette (fastai's ten easy ImageNet classes), found or fetched from its official archive.

``data.dataset = "imagenette"`` names the set; ``data.imagenette_size`` picks the archive,
``imagenette2-160.tgz`` or ``imagenette2-320.tgz`` (the shorter side of the images). Where it
is looked for, in order:

1. ``--data-dir DIR`` (or ``data.path``) itself, when it has ``train/`` and ``val/`` holding the
   ten class folders: a copy the user unpacked, used as it is (the classes are checked, the
   image counts are not);
2. ``imagenette2-160/`` (or ``-320/``) in DIR and then in the places the built-in sets are
   searched (``$SPEEDRUN_DATA``, ``~/.cache/speedrun``): checked (classes and image counts);
3. the archive in one of those places, or else downloaded from fastai's S3 bucket (or
   ``$SPEEDRUN_MIRROR``) into the first writable one.

An archive is checked before it is unpacked (its size and md5, where the spec knows them),
extracted safely into a staging folder, checked there (``train/`` and ``val/`` with exactly the
ten class folders and the official number of images) and only then moved into place, so no
partial folder is ever left. A downloaded archive that fails is removed again; one the user put
there is kept. The recipe is then rewritten to ``data.dataset = "folder"`` with ``data.path``
the unpacked folder, and the image-folder pipeline does the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...errors import DataError
from ...recipe import Recipe
from .builtin import _mirror, search_roots, unpack_checked, writable_root
from .download import download, md5sum
from .folder import IMAGE_EXTENSIONS

BASE_URL = "https://s3.amazonaws.com/fast-ai-imageclas/"

CLASSES = ("n01440764", "n02102040", "n02979186", "n03000684", "n03028079",
           "n03394916", "n03417042", "n03425413", "n03445777", "n03888257")


@dataclass(frozen=True)
class ImagenetteSpec:
    """One archive of the set and what it must hold once unpacked."""
    archive: str                        # file name, under ``url``
    folder: str                         # the folder inside the archive
    size: int | None                    # bytes of the archive; None: not checked
    md5: str | None                     # of the archive; None: not checked
    train: int                          # images in train/
    val: int                            # images in val/
    classes: tuple[str, ...] = CLASSES  # exactly these class folders in train/ and val/
    url: str = BASE_URL
    extra_roots: tuple[str, ...] = ()   # more places to look (as for the built-in sets)


# Sizes as published with the archives; md5s as torchvision's Imagenette checks them.
OFFICIAL = {
    160: ImagenetteSpec("imagenette2-160.tgz", "imagenette2-160", 99_003_388,
                        "e793b78cc4c9e9a4ccc0c1155377a412", train=9_469, val=3_925),
    320: ImagenetteSpec("imagenette2-320.tgz", "imagenette2-320", 341_663_724,
                        "3df6f0d01a2c9592104656642f5e78a3", train=9_469, val=3_925),
}


def resolve_imagenette(recipe: Recipe, data_dir=None, spec: ImagenetteSpec | None = None) -> Recipe:
    """``recipe`` (``data.dataset = "imagenette"``) rewritten to the image folder that holds the
    set: ``data.dataset = "folder"``, ``data.path`` = the folder (found, unpacked or downloaded).
    ``spec``: the archive to expect (default: the official one of ``data.imagenette_size``)."""
    spec = spec or OFFICIAL[recipe.data.imagenette_size]
    folder = locate_imagenette(spec, recipe.data.path or data_dir)
    resolved = recipe.with_values({"data.dataset": "folder", "data.path": str(folder)})
    # the user's --set values, applied again later, must not undo the rewrite
    resolved._overrides = [o for o in recipe._overrides
                           if o.split("=", 1)[0].strip() not in ("data.dataset", "data.path")]
    return resolved


def locate_imagenette(spec: ImagenetteSpec, where=None) -> Path:
    """The checked folder holding the set: ``where`` itself, found, unpacked or downloaded."""
    if where:
        given = Path(where).expanduser()
        if any((given / "train" / c).is_dir() for c in spec.classes):     # the user's unpacked copy: used as it is
            check_folder(spec, given, counts=False, fix=(
                f"Point --data-dir (or data.path) at an unpacked Imagenette, or at the folder holding "
                f"{spec.folder}/ or {spec.archive}; or train {given} as it is with --set data.dataset=folder."))
            return given
    roots = search_roots(spec, where)
    looked = []
    for root in roots:
        folder = root / spec.folder
        looked.append(str(folder))
        if _unpacked_here(folder):
            check_folder(spec, folder)
            return folder
        archive = root / spec.archive
        looked.append(str(archive))
        if archive.is_file():
            with writable_root(roots, prefer=root) as dest:
                return unpack(spec, archive, dest)
    url = _mirror(spec) + spec.archive
    with writable_root(roots) as dest:
        try:
            archive = download(url, dest / spec.archive)
        except ConnectionError as err:
            raise DataError(_missing_message(spec, looked, err)) from None
        try:
            return unpack(spec, archive, dest, fix=f"The download was removed again; check {url} and try again.")
        except DataError:
            archive.unlink(missing_ok=True)         # what speedrun fetched and refused is not kept
            raise


def _unpacked_here(folder: Path) -> bool:
    return (folder / "train").is_dir() or (folder / "val").is_dir()


def _missing_message(spec: ImagenetteSpec, looked: list[str], err: Exception) -> str:
    lines = [f"dataset 'imagenette' ({spec.archive}) not found. Looked in:"] + [f"  {p}" for p in looked]
    lines.append(f"and the download failed: {err}")
    lines.append(f"To provide it, put {spec.archive} from {spec.url} (or its unpacked {spec.folder}/) into DIR/ "
                 "and pass --data-dir DIR or set SPEEDRUN_DATA=DIR; with a network connection speedrun "
                 "downloads it itself.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# Checking and unpacking
# ------------------------------------------------------------------------------------------

def check_archive(spec: ImagenetteSpec, archive: Path, fix: str) -> None:
    """Size and md5 of the archive, where ``spec`` knows them, before anything is extracted."""
    size = archive.stat().st_size
    if spec.size is not None and size != spec.size:
        kind = "truncated" if size < spec.size else "too large"
        raise DataError(f"{archive}: {kind}: {size:,} bytes, expected {spec.size:,}. {fix}")
    if spec.md5 is not None and (got := md5sum(archive)) != spec.md5:
        raise DataError(f"{archive}: checksum mismatch (md5 {got}, expected {spec.md5}); the archive is corrupt "
                        f"or not the official {spec.archive}. {fix}")


def unpack(spec: ImagenetteSpec, archive: Path, root: Path, fix: str | None = None) -> Path:
    """Check ``archive``, extract it into a staging folder in ``root``, check what it held and
    only then move it to ``root/<folder>``; on any failure nothing is left in ``root``."""
    fix = fix or f"Delete {archive} and let speedrun download it again."
    check_archive(spec, archive, fix)
    return unpack_checked(archive, root, spec.folder, spec.archive,
                          lambda extracted: check_folder(spec, extracted, fix, archive=archive), fix)


def _count_images(folder: Path) -> int:
    """Images under ``folder``, counted as the image-folder pipeline finds them."""
    return sum(1 for p in folder.rglob("*") if p.suffix.lower() in IMAGE_EXTENSIONS and p.is_file())


def check_folder(spec: ImagenetteSpec, folder: Path, fix: str | None = None, archive: Path | None = None,
                 counts: bool = True) -> None:
    """``train/`` and ``val/`` hold exactly the set's class folders and (with ``counts``) its
    number of images. Errors name the archive and the member as it appears in the archive
    (``archive``: ``folder`` was extracted from it), or else the folder."""
    fix = fix or (f"Delete {folder} and let speedrun unpack or download the set again, or train on it as it is "
                  f"with --set data.dataset=folder --set data.path={folder}.")
    for split, expected in (("train", spec.train), ("val", spec.val)):
        sub = folder / split
        where = f"{archive}: member {spec.folder}/{split}" if archive else str(sub)
        if not sub.is_dir():
            raise DataError(f"{where}: missing; Imagenette has train/ and val/. {fix}")
        found = {p.name for p in sub.iterdir() if p.is_dir() and not p.name.startswith(".")}
        missing = sorted(set(spec.classes) - found)
        extra = sorted(found - set(spec.classes))
        if missing:
            more = f" (and {len(missing) - 1} more class folders)" if len(missing) > 1 else ""
            raise DataError(f"{where}/{missing[0]}: missing{more}; Imagenette has the {len(spec.classes)} class "
                            f"folders {', '.join(spec.classes)}. {fix}")
        if extra:
            raise DataError(f"{where}: holds class folders that are not Imagenette's ({', '.join(extra[:5])}). {fix}")
        if counts and (got := _count_images(sub)) != expected:
            raise DataError(f"{where}: holds {got:,} images, expected {expected:,}; it is incomplete or not "
                            f"the official {spec.archive}. {fix}")
