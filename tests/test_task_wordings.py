"""The RULER generators take a wording: the template families of :mod:`headscope.tasks.formats` (``seen`` /
``unseen`` / ``train``) are data passed to the generators' draws of :mod:`headscope.tasks.ruler`, and every prompt
is byte-for-byte the prompt of the code before that change.

The digests below were computed at commit e91faf4 (where ``formats.py`` still re-implemented the three RULER
generators) with the same calls; the committed study results (retention suite, stage-3 rows) depend on these exact
prompts. Each digest is SHA-256 (first 16 hex digits) over every pair's clean and corrupted token ids, answer and
counter-answer ids, evidence span, task and meta.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from headscope.tasks import formats, ruler
from headscope.tasks.filler import Filler

#: "family/task/seq_len/seed" (or "ruler/task/...": the plain generators) -> digest at e91faf4
AT_E91FAF4 = {
    "seen/niah_single/160/0": "8d13122810cbb4a3",
    "seen/niah_single/160/1": "c6e56d0f077b4c9c",
    "seen/niah_single/300/0": "8ce1c76a1ce6609d",
    "seen/niah_single/300/1": "c9a3f22332740dd3",
    "seen/niah_multikey/160/0": "b789ad77e4e2ba8f",
    "seen/niah_multikey/160/1": "f4c44e53a5df4cc2",
    "seen/niah_multikey/300/0": "98775604cdf6b4e3",
    "seen/niah_multikey/300/1": "ac0cc9ecb650f87f",
    "seen/niah_multivalue/160/0": "f569330e81436e8a",
    "seen/niah_multivalue/160/1": "80bd68469c55884a",
    "seen/niah_multivalue/300/0": "e7aec4dd352c5688",
    "seen/niah_multivalue/300/1": "89094c3b2b2c3a75",
    "seen/variable_tracking/160/0": "28b580d82d5e69b4",
    "seen/variable_tracking/160/1": "84df6240457d6009",
    "seen/variable_tracking/300/0": "a306c9078ba5960e",
    "seen/variable_tracking/300/1": "c4d0a9fc457a0460",
    "unseen/niah_single/160/0": "3aedbd2373c9b2d8",
    "unseen/niah_single/160/1": "6e0632f6f8f1da66",
    "unseen/niah_single/300/0": "bd8f6d30764ebcee",
    "unseen/niah_single/300/1": "8489d5f20fa80e5f",
    "unseen/niah_multikey/160/0": "252f2e054ea0d9e6",
    "unseen/niah_multikey/160/1": "5d2427b236bf7c18",
    "unseen/niah_multikey/300/0": "b0dd94ae32eae2ef",
    "unseen/niah_multikey/300/1": "eadef85c2bca0ffe",
    "unseen/niah_multivalue/160/0": "d052199d7492af42",
    "unseen/niah_multivalue/160/1": "0849ce232c17dfb7",
    "unseen/niah_multivalue/300/0": "77a87d64e5e4e1a3",
    "unseen/niah_multivalue/300/1": "f21b4c2796e108a0",
    "unseen/variable_tracking/160/0": "2e8e8e9f3cabcab6",
    "unseen/variable_tracking/160/1": "145c6eb1e9f36bf4",
    "unseen/variable_tracking/300/0": "8b38fc4d42abd60b",
    "unseen/variable_tracking/300/1": "43cba6597bb271eb",
    "train/niah_single/160/0": "fc426a17dfddba57",
    "train/niah_single/160/1": "a4d737e5bcd8ac2c",
    "train/niah_single/300/0": "df022f4cd3a5f64b",
    "train/niah_single/300/1": "535a80a225dc4673",
    "train/niah_multikey/160/0": "ea928fecd47b3f8a",
    "train/niah_multikey/160/1": "0120863941f5eff7",
    "train/niah_multikey/300/0": "ff39f99781c6bcea",
    "train/niah_multikey/300/1": "cc2232e855103089",
    "train/niah_multivalue/160/0": "c3f072e557638d17",
    "train/niah_multivalue/160/1": "591913eca0a2562c",
    "train/niah_multivalue/300/0": "114e8722d04cc5c0",
    "train/niah_multivalue/300/1": "108d522b69b85502",
    "train/variable_tracking/160/0": "21255ed6d27d1f9b",
    "train/variable_tracking/160/1": "53f63d669ae4aa05",
    "train/variable_tracking/300/0": "5e57038129de58c9",
    "train/variable_tracking/300/1": "3fb4883ececbd2e9",
    "ruler/niah_multikey/160/0": "fd89a5f26f62a436",
    "ruler/niah_multikey/160/1": "467175a94d816519",
    "ruler/niah_multikey/300/0": "b30727136e633530",
    "ruler/niah_multikey/300/1": "b69ae877bfc30f4a",
    "ruler/niah_multivalue/160/0": "690b3554841d5017",
    "ruler/niah_multivalue/160/1": "7ab8f22d0b3800d9",
    "ruler/niah_multivalue/300/0": "c43f2428db348286",
    "ruler/niah_multivalue/300/1": "081e436bc981d388",
    "ruler/variable_tracking/160/0": "6228c4d92f67e05a",
    "ruler/variable_tracking/160/1": "d2f9a60c5e5c854a",
    "ruler/variable_tracking/300/0": "c6ce4bde98ecfc7c",
    "ruler/variable_tracking/300/1": "774048ca6697e23d",
}


def digest(pairs) -> str:
    h = hashlib.sha256()
    for q in pairs:
        h.update(json.dumps([q.clean.tolist(), q.corrupted.tolist(), q.answer.tolist(), q.counter_answer.tolist(),
                             list(q.evidence), q.task, q.meta], sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


@pytest.mark.parametrize("family", ["seen", "unseen", "train"])
def test_family_prompts_are_those_of_e91faf4(smol_tokenizer, family):
    """Every task of the family at two lengths and two seeds (3 pairs at depths 0.2 / 0.7)."""
    got = {}
    for task in formats.FORMAT_TASKS:
        for seq_len in (160, 300):
            for seed in (0, 1):
                pairs = formats.format_pairs(smol_tokenizer, family, task, Filler(None), n_pairs=3, seq_len=seq_len,
                                             seed=seed, depth=(0.2, 0.7))
                got[f"{family}/{task}/{seq_len}/{seed}"] = digest(pairs)
    want = {k: v for k, v in AT_E91FAF4.items() if k.startswith(family + "/")}
    assert len(want) == 16 and got == want


def test_ruler_generators_prompts_are_those_of_e91faf4(smol_tokenizer):
    got = {}
    for task in ("niah_multikey", "niah_multivalue", "variable_tracking"):
        for seq_len in (160, 300):
            for seed in (0, 1):
                pairs = getattr(ruler, task)(smol_tokenizer, n_pairs=3, seq_len=seq_len, seed=seed, depth=(0.2, 0.7))
                got[f"ruler/{task}/{seq_len}/{seed}"] = digest(pairs)
    want = {k: v for k, v in AT_E91FAF4.items() if k.startswith("ruler/")}
    assert len(want) == 12 and got == want


def test_seen_family_is_the_generators_wording():
    """One wording per task, defined once: the seen family holds the RULER generators' wordings themselves."""
    for task, w in ruler.RULER_WORDINGS.items():
        assert formats.SEEN.wordings[task] == (w,)
    assert formats.SEEN.keys == ruler.KEY_WORDS and formats.SEEN.var_names == ruler.VAR_NAMES
