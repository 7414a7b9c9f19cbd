"""Every key of the roster and of the remediator's config has a row in its page's key tables.

The keys are found by walking the pydantic models the loaders validate with, from the top
(`fleet.roster.Roster`, `remediator.config.RemediatorConfig`) through every nested model a
field can hold: directly, optionally, in a dict's values or keys, a list or tuple, a union or
an `Annotated` type. A field's alias, when it has one, is what a user writes, so it is the key.

A key is documented when its page has a table row that starts with it in backticks
(`| \\`count\\` | integer ≥ 0 | ...`): prose that merely mentions a key is not its reference.
A key added to a model without a row on its page fails here, naming every missing key and
the model it belongs to.
"""

from __future__ import annotations

import importlib
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import pytest
from pydantic import AliasChoices, BaseModel, Field

from tests.test_docs import FENCE

REPO = Path(__file__).resolve().parent.parent

PAGES = [
    ("roster.md", "fleet.roster", "Roster"),
    ("remediator-config.md", "remediator.config", "RemediatorConfig"),
]

ROW_KEY = re.compile(r"^\|\s*`([^`\n]+)`\s*\|", re.MULTILINE)


def nested_models(annotation: Any) -> Iterator[type[BaseModel]]:
    """The models a field of this type can hold, at any depth of its type arguments."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    # Optional, X | Y, Union, dict, list, tuple, Annotated (its metadata are not types).
    for arg in typing.get_args(annotation):
        yield from nested_models(arg)


def field_keys(name: str, field: Any) -> set[str]:
    """What a user may write for this field: its alias (or its name), and alias choices."""
    keys = {field.alias or name}
    choices = field.validation_alias
    if isinstance(choices, str):
        keys.add(choices)
    elif isinstance(choices, AliasChoices):
        keys |= {choice for choice in choices.choices if isinstance(choice, str)}
    return keys


def model_keys(root: type[BaseModel]) -> dict[str, set[str]]:
    """Every key of `root` and the models nested in it, each with the models it belongs to."""
    keys: dict[str, set[str]] = {}
    seen: set[type[BaseModel]] = set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        for name, field in model.model_fields.items():
            for key in field_keys(name, field):
                keys.setdefault(key, set()).add(model.__name__)
            for inner in nested_models(field.annotation):
                walk(inner)

    walk(root)
    return keys


def documented_keys(text: str) -> set[str]:
    """The keys the page's tables have a row for (outside fenced code blocks)."""
    return set(ROW_KEY.findall(FENCE.sub("", text)))


def missing_keys(root: type[BaseModel], text: str) -> list[str]:
    """`key (Model, ...)` for every key of the models without a row on the page, sorted."""
    documented = documented_keys(text)
    return [
        f"{key} ({', '.join(sorted(models))})"
        for key, models in sorted(model_keys(root).items())
        if key not in documented
    ]


def root_model(module: str, name: str) -> type[BaseModel]:
    model = getattr(importlib.import_module(module), name)
    assert isinstance(model, type) and issubclass(model, BaseModel)
    return model


@pytest.mark.parametrize(("page", "module", "name"), PAGES, ids=[p for p, _, _ in PAGES])
def test_every_key_has_a_row_on_its_page(page: str, module: str, name: str) -> None:
    text = (REPO / "docs" / page).read_text(encoding="utf-8")
    missing = "; ".join(missing_keys(root_model(module, name), text))
    assert not missing, f"docs/{page} has no key-table row (| `key` | ...) for: {missing}"


def test_the_walk_reaches_every_kind_of_nesting() -> None:
    class Leaf(BaseModel):
        leaf_key: int = 0

    class InDict(BaseModel):
        dict_key: int = 0

    class InList(BaseModel):
        list_key: int = 0

    class InUnion(BaseModel):
        union_key: int = 0

    class Root(BaseModel):
        direct: Leaf
        optional: Annotated[InUnion | None, Field(description="x")] = None
        mapping: dict[str, InDict] = {}
        listed: list[tuple[InList, ...]] = []
        aliased: int = Field(default=0, alias="written-key")

    assert set(model_keys(Root)) == {
        "direct",
        "optional",
        "mapping",
        "listed",
        "written-key",
        "leaf_key",
        "union_key",
        "dict_key",
        "list_key",
    }
    # The real models: keys only nested models have are found.
    roster = model_keys(root_model("fleet.roster", "Roster"))
    assert {"critical_celsius", "pci_bus_ids", "admin_key_file", "max_tokens"} <= set(roster)
    config = model_keys(root_model("remediator.config", "RemediatorConfig"))
    assert {"bearer_token_file", "username", "allowed_key_patterns"} <= set(config)
    assert {"auth", "admin"} <= set(config) and config["username"] >= {"BasicAuthSettings"}


def test_the_check_fails_for_a_key_without_a_row() -> None:
    roster = root_model("fleet.roster", "Roster")
    text = (REPO / "docs" / "roster.md").read_text(encoding="utf-8")
    assert missing_keys(roster, text) == []
    # Its row gone, a key mentioned only in prose or in an example block is still missing.
    without = re.sub(r"^\| `critical_celsius` \|.*\n", "", text, flags=re.MULTILINE)
    assert without != text
    without += "\nProse naming `critical_celsius`.\n\n```yaml\n| `critical_celsius` |\n```\n"
    assert missing_keys(roster, without) == ["critical_celsius (ThermalLimit)"]
