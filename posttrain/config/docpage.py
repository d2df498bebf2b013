"""docs/config.md: posttrain's keys with their defaults and the documentation written beside their fields (schema/),
then every other key of the familiar tree with the key table's decision on it (keytable.py).

`python -m posttrain.config.docpage` rewrites the page below its marker line; a test fails when the page is stale.
"""

from __future__ import annotations

from pathlib import Path

from .fielddocs import descriptions
from .keytable import describe, find_rule
from .loader import all_keys, default_of

INTRO_END = "<!-- everything below is generated: python -m posttrain.config.docpage -->"


def render(familiar_keys: list[str], intro: str) -> str:
    """The page: the intro, posttrain's keys by section, then every other familiar key and its decision."""
    docs = descriptions()
    out = [intro.rstrip(), ""]
    section = None
    for key in all_keys():
        top = key.split(".")[0]
        if top != section:
            section = top
            out += ["", f"## {top}", "", "| key | default | what it does |", "|---|---|---|"]
        default = default_of(key)
        shown = "null" if default is None else default
        out.append(f"| `{key[len(top) + 1:]}` | {shown} | {docs[key]} |")
    ours = set(all_keys())
    others = sorted(k for k in set(familiar_keys) if k not in ours)
    out += ["", "## Keys posttrain does not act on", "",
            "Every other key of the familiar schema, and what posttrain does when a command line sets it.", "",
            "| key | decision |", "|---|---|"]
    mappings = [k for k in ours if isinstance(default_of(k), dict)]
    for key in others:
        found = find_rule(key)
        field = next((m for m in mappings if key.startswith(m + ".")), None)
        decision = (describe(*found) if found else
                    f"an entry of `{field}`, which posttrain acts on" if field else "unknown")
        out.append(f"| `{key}` | {decision} |")
    return "\n".join(out) + "\n"


def main() -> None:
    """Regenerate docs/config.md below its marker line."""
    root = Path(__file__).resolve().parents[2]
    doc = root / "docs" / "config.md"
    intro = doc.read_text().split(INTRO_END)[0] + INTRO_END
    keys = (root / "docs" / "familiar_keys.txt").read_text().split()
    doc.write_text(render(keys, intro))


if __name__ == "__main__":
    main()
