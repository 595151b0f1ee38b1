"""What only a fresh interpreter can show: the pure parts import no torch; the tree uses only the new names."""

import subprocess
import sys
from pathlib import Path


def test_pure_parts_import_no_torch():
    code = ("import sys, modelpar, modelpar.schedules, modelpar.simulate, modelpar.costmodel; "
            "modelpar.clock_cycles; modelpar.get_schedule; modelpar.Costs; modelpar.estimate; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_importing_the_simulator_loads_neither_torch_nor_the_planner_search():
    # the simulator and the tensor-parallel accounting share modelpar.formulas, a leaf
    code = ("import sys, modelpar.simulate, modelpar.schedules, modelpar.formulas\n"
            "print(sorted(m for m in ('torch', 'modelpar.costmodel', 'modelpar.costmodel.search') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_memory_model_imports_no_torch():
    code = ("import sys, modelpar.recompute as r; r.gpipe_activation_memory(256, 48, 4, 32, True); "
            "assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_tree_uses_only_the_new_names():
    """tools/rename_ranks.py --check: nothing left to rename (rerun the codemod after merging old-name code)."""
    import subprocess
    import sys

    tool = Path(__file__).resolve().parents[2] / "tools" / "rename_ranks.py"
    run = subprocess.run([sys.executable, str(tool), "--check"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
