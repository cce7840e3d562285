"""rocdraft.bench.corpus: the standard-library split of the built-in pair and its held-out prompts."""
from __future__ import annotations

from rocdraft.bench.corpus import heldout_files, heldout_prompts, is_heldout, stdlib_root, training_files


def test_split_is_disjoint_and_follows_the_letter_rule():
    held, train = heldout_files(), training_files()
    assert held and train and not set(held) & set(train)
    root = stdlib_root()
    for path in held:
        assert path.parent == root and path.name[0].lower() in "rstuvwxyz"
    for path in train:
        rel = path.relative_to(root)
        assert not is_heldout(path)
        assert not {"test", "tests", "site-packages", "__pycache__"} & set(rel.parts[:-1])


def test_prompts_end_with_a_header_and_respect_the_budget():
    prompts = heldout_prompts(n=8, prompt_tokens=60, seed=3, tokenizer=lambda s: s.split())
    assert len(prompts) == 8
    for prompt in prompts:
        header = prompt.splitlines()[-1].lstrip()
        assert header.startswith(("def ", "class ", "async def ")) and header.endswith(":")
        assert len(prompt.split()) <= 60 or len(prompt.splitlines()) == 1
    assert heldout_prompts(n=8, prompt_tokens=60, seed=3, tokenizer=lambda s: s.split()) == prompts


def test_a_link_out_of_the_root_is_classified_by_its_place_in_the_root(tmp_path):
    # Debian links /usr/lib/python3.X/sitecustomize.py to /etc/python3.X/sitecustomize.py;
    # resolving it first left the stdlib root ("is not in the subpath") and broke the bench.
    root, outside = tmp_path / "lib", tmp_path / "etc"
    root.mkdir()
    outside.mkdir()
    (outside / "sitecustomize.py").write_text("x = 1\n")
    (root / "sitecustomize.py").symlink_to(outside / "sitecustomize.py")
    (root / "abc.py").write_text("y = 2\n")
    assert is_heldout(root / "sitecustomize.py", root)
    assert not is_heldout(root / "abc.py", root)
