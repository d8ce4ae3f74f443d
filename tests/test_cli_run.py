"""`parrot run SCRIPT` runs a script as `python SCRIPT` would: its directory is importable (the examples import
their siblings, e.g. examples/_common.py), its arguments reach sys.argv, and --url reaches PARROT_URL."""

from __future__ import annotations

import subprocess
import sys


def test_parrot_run_puts_the_scripts_directory_on_the_path(tmp_path):
    (tmp_path / "_sibling.py").write_text("VALUE = 'from the sibling'\n")
    script = tmp_path / "app.py"
    script.write_text("import os, sys\nfrom _sibling import VALUE\nprint(VALUE, sys.argv[1:], os.environ['PARROT_URL'])\n")
    out = subprocess.run([sys.executable, "-m", "parrot.cli", "run", "--url", "http://127.0.0.1:9", str(script),
                          "a", "b"], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "from the sibling ['a', 'b'] http://127.0.0.1:9"
