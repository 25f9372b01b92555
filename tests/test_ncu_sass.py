"""tools/ncu_sass.py on the committed Nsight Compute profiles (results/h200/ncu-sass/): the numbers that
results/h200/ncu-sass/README.md and the Lab 06 notes (results/notes/06_paged_ragged.md) cite come out of the files as
committed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ROOT / "results" / "h200" / "ncu-sass"


def ncu_sass():
    spec = importlib.util.spec_from_file_location("ncu_sass", ROOT / "tools" / "ncu_sass.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tile_instructions_and_waits_of_the_small_paged_profiles(capsys):
    tool = ncu_sass()
    main = tool.kernels(str(FILES / "ncu-small-paged-b40a849-sass.csv.gz"))
    pool32 = tool.kernels(str(FILES / "ncu-small-paged-pool32-cce8af0-sass.csv.gz"))
    assert len(main) == len(pool32) == 2        # over pages, then the contiguous cache
    lines = [tool.summary(k, None) for k in main + pool32]
    tiles = [int(s[2].split(":")[1].split()[0]) for s in lines]
    assert tiles == [373, 356, 343, 356], tiles  # the 32-bit build issues fewer a tile than the contiguous one
    waits = [int(s[2].split(";")[1].split()[0]) for s in lines]
    assert waits[0] > waits[1] and waits[2] > waits[3], waits   # yet over pages the tile waits longer for K/V
    assert all(s[0].startswith("warps 512, tiles a warp 8.0") for s in lines)
    assert tool.main([str(FILES / "ncu-uniform-b40a849-sass.csv.gz")]) == 0
    out = capsys.readouterr().out
    assert out.count("kernel ") == 2 and "before the loop 1284" in out and "before the loop 790" in out
