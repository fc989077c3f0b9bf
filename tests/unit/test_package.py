"""The package's public names resolve (imported on first use), and what needs no model (a command's help, a bad flag)
imports neither transformers nor torch (once about 6 s each on a 2-core VM)."""

import importlib
import pkgutil
import subprocess
import sys
import types

import pytest

import ulysses_sp


def test_every_public_name_is_its_module_s_object():
    assert sorted(ulysses_sp.__all__) == sorted(ulysses_sp._HOME)
    for name in ulysses_sp.__all__:
        home = importlib.import_module(ulysses_sp._HOME[name], "ulysses_sp")
        assert getattr(ulysses_sp, name) is getattr(home, name), name


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="paralelize"):
        ulysses_sp.paralelize  # noqa: B018


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    script = f"{code}\nimport sys\nprint('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    return set(out.stdout.split())


def _cli(argv: list[str]) -> str:
    """Code that runs ``ulysses-sp ARGV`` in-process, quietly, and checks it answered (status 0) or named a bad flag
    (2)."""
    return (
        "import contextlib, io\n"
        "from ulysses_sp.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    try:\n"
        f"        status = main({argv!r})\n"
        "    except SystemExit as exit:\n"
        "        status = exit.code\n"
        "assert status in (0, 2), status\n"
    )


def test_help_and_a_bad_flag_do_not_import_transformers():
    for argv in (
        ["plan", "--model", "llama-3.1-8b", "--seq-len", "65536", "--sp", "3"],
        ["train", "--seq-len", "0"],
        ["plan", "--help"],
    ):
        assert "transformers" not in _modules_after(_cli(argv)), argv
    # before any name is read, dir() lists them all (tab completion), and transformers is not loaded
    listed = "import ulysses_sp\nassert set(ulysses_sp.__all__) <= set(dir(ulysses_sp))"
    assert "transformers" not in _modules_after(listed)
    # a model's name resolves on first use, and brings transformers with it
    assert "transformers" in _modules_after("import ulysses_sp\nulysses_sp.parallelize")


def test_help_and_a_bad_flag_answer_without_importing_torch():
    # torch (and through the kernels torch._dynamo) took 5-7 s of every `--help` before the flags' modules stopped
    # importing it at the top; the answer is now a fraction of a second
    for argv in (
        ["train", "--help"],
        ["train", "--sp", "2", "--seq-len", "0"],  # without --sp the default follows the GPU count (torch)
        ["train", "--no-such-flag"],
        ["train", "--dataset", "a.jsonl", "b.jsonl"],  # an unquoted glob the shell expanded
        ["--version"],
        ["plan", "--help"],
        ["plan", "--model", "llama-tiny", "--seq-len", "0"],
        ["bench", "--help"],
        ["bench", "--worlds", "x"],
    ):
        assert "torch" not in _modules_after(_cli(argv)), argv


def test_the_version_and_a_mistyped_command(capsys):
    """`ulysses-sp --version` was "unknown command '--version'"; a mistyped command gets the one it is closest to."""
    from ulysses_sp.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"ulysses-sp {ulysses_sp.__version__}\n"
    assert main(["trian"]) == 2
    assert "unknown command 'trian' (did you mean 'train'?)" in capsys.readouterr().err


@pytest.mark.parametrize("package", ["ulysses_sp", "ulysses_sp.plan", "ulysses_sp.tiled_loss"])
def test_no_public_name_of_a_lazy_package_is_also_a_submodule_s_name(package):
    # importing the submodule binds its name on the package, and __getattr__ is never asked again: the name would
    # be the module (ulysses_sp.plan.recommend once `ulysses-sp plan` had run, until plan/recommend.py was renamed)
    module = importlib.import_module(package)
    assert not set(module._HOME) & {info.name for info in pkgutil.iter_modules(module.__path__)}


@pytest.mark.parametrize("package", ["ulysses_sp.plan", "ulysses_sp.tiled_loss"])
def test_a_subpackage_resolves_its_public_names_on_first_use(package):
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(module._HOME)
    assert set(module.__all__) <= set(dir(module))
    for info in pkgutil.iter_modules(module.__path__):  # every submodule imported first, as a program may have
        importlib.import_module(f"{package}.{info.name}")
    for name in module.__all__:
        value = getattr(module, name)
        assert not isinstance(value, types.ModuleType), name
        assert value is getattr(importlib.import_module(module._HOME[name], package), name), name
    with pytest.raises(AttributeError, match="no_such_name"):
        module.no_such_name  # noqa: B018


def test_a_plan_reads_transformers_configs_not_its_model_code():
    found = _modules_after(_cli(["plan", "--model", "llama-3.1-8b", "--seq-len", "65536", "--sp", "8", "--json"]))
    assert "transformers.models.auto.configuration_auto" in found
    assert "transformers.modeling_utils" not in found


def test_a_submodule_resolves_without_its_own_import():
    assert "ulysses_sp.traffic" in _modules_after("import ulysses_sp\nulysses_sp.traffic.ulysses_bytes_per_layer")
