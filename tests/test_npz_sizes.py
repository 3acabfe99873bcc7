"""An .npz entry whose header declares more than the entry holds (a data file claiming 51
TB, a checkpoint slot claiming 400 TB) is the reader's one-line error, checked before numpy
allocates the declared shape (npz_files.read_entry)."""
from __future__ import annotations

import numpy as np
import pytest

from faults.harness import lying_npz
from kfac_compiler.errors import CheckpointError, DataError
from kfac_compiler.npz_files import read_entry
from kfac_compiler.runtime.data import load_npz


def test_the_declared_size_is_checked_against_the_entry(tmp_path):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    ok, bad = tmp_path / "ok.npz", tmp_path / "bad.npz"
    lying_npz(ok, {"x": x}, "x", (3, 4))  # an honest header written the same way
    with np.load(ok) as z:
        np.testing.assert_array_equal(read_entry(z, "x"), x)
    lying_npz(bad, {"x": x}, "x", (10**7, 10**6))
    with np.load(bad) as z, pytest.raises(ValueError) as got:
        read_entry(z, "x")
    assert str(got.value) == "entry 'x' declares a 10000000x1000000 float32 array (36.4 TiB) but holds 48 B"


def test_a_data_file_claiming_51_tb_is_one_line(tmp_path):
    path = tmp_path / "data.npz"
    lying_npz(path, {"input": np.zeros((4, 64), np.float32), "targets": np.zeros(4, np.int64)}, "input",
              (4, 12_750_000_000_000 // 4))
    with pytest.raises(DataError) as got:
        load_npz(str(path))
    assert str(got.value) == (f"data file {str(path)!r} is not a readable .npz (entry 'input' declares a "
                              "4x3187500000000 float32 array (46.4 TiB) but holds 1.0 KiB)")


def test_a_checkpoint_slot_claiming_400_tb_is_one_line(tmp_path):
    import kfac_compiler as kc
    from kfac_compiler.models import ZOO
    from kfac_compiler.runtime import Trainer

    e = ZOO["mlp_classifier"]
    tr = Trainer(kc.compile(e.build(seed=0), loss=e.loss, output=e.output_name, emit=False), optimizer="sgd",
                 learning_rate=0.1)
    good, bad = tmp_path / "good.ckpt", tmp_path / "bad.ckpt"
    tr.save_checkpoint(good)
    with np.load(good) as z:
        arrays = {k: z[k] for k in z.files}
    lying_npz(bad, arrays, "slot_00000", (10**8, 10**6))
    with pytest.raises(CheckpointError) as got:
        Trainer.load_checkpoint(bad, tr.plan)
    n = arrays["slot_00000"].nbytes
    assert str(got.value) == (f"checkpoint {str(bad)!r} is corrupt: entry 'slot_00000' declares a "
                              f"100000000x1000000 float32 array (363.8 TiB) but holds {n / 1024:.1f} KiB; "
                              "use an earlier copy")
