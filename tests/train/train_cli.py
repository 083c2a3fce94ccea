"""``jaxcnn-train`` in-process for the trainer tests (imported as ``train_cli``)."""
import contextlib
import io

from jaxcnn.train.cli import train_main


def cli(args):
    """Runs ``train_main`` on ``args`` (any objects, as strings); returns (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


def one_line(code, err):
    """The one error line of a refused run (exit 2, no traceback)."""
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("jaxcnn-train: error: "), (code, err)
    assert "Traceback" not in err
    return lines[0]
