"""tests/mutation_check.py: every mutation still applies to the code it patches.

A refactor that moves a mutation's text makes the full mutation run stop at its start (it checks every patch
first); this catches it at the commit that moved the text, not at the next mutation run."""

import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_mutation_patches_one_place_of_its_file():
    mutations = runpy.run_path(str(ROOT / "tests" / "mutation_check.py"), run_name="mutation_check")["MUTATIONS"]
    assert len(mutations) > 100
    stale = [f"{m.name}: {(ROOT / m.path).read_text().count(m.old)} copies in {m.path}"
             for m in mutations if (ROOT / m.path).read_text().count(m.old) != 1]
    assert not stale, "update these mutations in tests/mutation_check.py:\n" + "\n".join(stale)
    assert len({m.name for m in mutations}) == len(mutations), "two mutations share a name"
