"""The resumable store reads JSON only: values round-trip exactly, and a pickled item (the old format, or a
file planted to run code when unpickled) is refused before anything is read."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch

from headscope.patching.store import PickledStore, Store, check_rank_store, decode, encode

RAN: list[str] = []


def _record(what: str) -> None:  # what the planted pickle would call
    RAN.append(what)


class Planted:
    def __reduce__(self):
        return (_record, ("unpickled code ran",))


def test_values_round_trip_exactly(tmp_path):
    st = Store(tmp_path, {"kind": "t"})
    value = {0: 0.1, 7: -1e-300, 3: math.nan, "patched": torch.randn(3, 4, dtype=torch.float64),
             "z32": torch.randn(5, dtype=torch.float32), "ok": [1, "two", None, True], "n": torch.tensor([1, 2])}
    st.put("pair00000_L000", value)
    back = Store(tmp_path, {"kind": "t"}).get("pair00000_L000")
    assert set(back) == set(value) and back[0] == 0.1 and back[7] == -1e-300 and math.isnan(back[3])
    for k in ("patched", "z32", "n"):
        assert back[k].dtype == value[k].dtype and torch.equal(back[k], value[k])
    assert back["ok"] == [1, "two", None, True]
    assert st.keys() == ["pair00000_L000"]
    with pytest.raises(TypeError, match="not Planted"):
        encode(Planted())
    with pytest.raises(ValueError, match="not a stored value"):
        decode({"__reduce__": "os.system"})


def test_pickled_item_is_refused_unread(tmp_path):
    """A store folder holding a pickle that would run code (the old ``.pt`` item format) is refused: neither
    opening the store nor the CLI's pre-load check unpickles it."""
    folder = tmp_path / "receivers"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"kind": "receivers"}))
    bomb = folder / "pair00000_L000.pt"
    torch.save(Planted(), bomb)
    with pytest.raises(PickledStore, match=r"old pickle format \(\*\.pt\).*rerun into a new output directory"):
        Store(tmp_path, {"kind": "receivers"}, name="receivers")
    with pytest.raises(PickledStore, match="old pickle format"):
        check_rank_store(tmp_path, ["niah_single"], False, "smollm2-135m", {}, 0.9, "noising")
    assert RAN == []
    with open(bomb, "rb") as f:  # the file does run code when unpickled: the refusal is what kept it from running
        pickle.load(f) if not bomb.read_bytes().startswith(b"PK") else torch.load(bomb, weights_only=False)
    assert RAN == ["unpickled code ran"]
    RAN.clear()


def test_item_file_that_is_not_json_is_refused(tmp_path):
    st = Store(tmp_path, {"kind": "t"})
    (st.dir / "pair00000_base.json").write_bytes(pickle.dumps(Planted()))
    with pytest.raises(ValueError, match="not a headscope store item"):
        st.get("pair00000_base")
    assert RAN == []
