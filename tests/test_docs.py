"""The docs name every recipe field and every shipped recipe."""
from pathlib import Path

from pydantic import BaseModel

from speedrun.recipe import Recipe, shipped_recipes

ROOT = Path(__file__).resolve().parents[1]


def field_paths(model: type[BaseModel], prefix: str = ""):
    for name, f in model.model_fields.items():
        options = getattr(f.annotation, "__args__", (f.annotation,))
        nested = [o for o in options if isinstance(o, type) and issubclass(o, BaseModel)]
        if nested:
            for n in nested:
                yield from field_paths(n, f"{prefix}{name}.")
        else:
            yield prefix + name


def test_every_recipe_field_is_documented():
    text = (ROOT / "docs" / "recipes.md").read_text()
    missing = sorted(p for p in set(field_paths(Recipe)) if f"`{p}`" not in text)
    assert not missing, f"undocumented recipe fields: {missing}"


def test_every_shipped_recipe_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in shipped_recipes())
