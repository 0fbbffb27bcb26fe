"""Every ``erase-tune`` command line written in deploy/ (manifests, compose, the Dockerfile,
comments, the README's code) is one that erase-tune's own argument parser accepts, so a
renamed or removed flag cannot leave a deploy file that fails only when someone runs it.

The finder itself is tested here too, on small pieces of shell: a finder that found nothing
would make the parsing test pass vacuously.
"""

from __future__ import annotations

import pytest

from erase_tune.cli import build_parser
from tests.deploy.deployfiles import (
    COMMAND_MENTION,
    Command,
    all_commands,
    deploy_files,
    exec_form,
    markdown_commands,
    rel,
    shell_commands,
)

COMMANDS = all_commands()


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: f"{c.where}: {c.line}")
def test_command_parses(command: Command, capsys: pytest.CaptureFixture[str]) -> None:
    code = 0
    try:
        build_parser().parse_args(list(command.argv))
    except SystemExit as e:
        code = e.code or 0  # --help exits 0 after printing: that parsed
    if code:
        message = capsys.readouterr().err.strip()
        pytest.fail(f"{command.where}: `{command.line}` is refused by erase-tune's parser: {message}", pytrace=False)


@pytest.mark.parametrize("path", deploy_files(), ids=rel)
def test_every_command_written_in_a_file_is_checked(path) -> None:
    """Each place a file says erase-tune plus a subcommand, the finder found a command: none
    can slip past the parsing test because it is written in a form the finder misses."""
    mentions = [m.group(0) for m in COMMAND_MENTION.finditer(path.read_text())]
    found = [c for c in COMMANDS if c.where.split(":")[0].split(" ")[0] == rel(path)]
    assert len(found) == len(mentions), (
        f"{rel(path)} names {len(mentions)} erase-tune commands ({mentions}) but {len(found)} were read "
        f"({[c.line for c in found]})"
    )


def test_the_commands_the_setup_depends_on_are_there() -> None:
    def lines(prefix: str) -> list[str]:
        return [c.line for c in COMMANDS if c.where.startswith(prefix)]

    for job in ("deploy/kuberay/jobs/ctr.yaml", "deploy/kuberay/jobs/own-workload.yaml"):
        run = lines(f"{job} doc 0 spec.entrypoint")
        assert [line.split()[1] for line in run] == ["db", "start"], f"{job}: db upgrade, then start: {run}"
    assert "erase-tune db upgrade" in lines("deploy/compose.yaml doc 0 services.migrate")
    dashboard = lines("deploy/compose.yaml doc 0 services.dashboard")
    assert any(line.startswith("erase-tune dashboard --host 0.0.0.0") for line in dashboard)
    readme = {line.split()[1] for line in lines("deploy/README.md")}
    assert {"start", "status", "export", "report", "dashboard", "db"} <= readme


# -- the finder ------------------------------------------------------------------------------


def argvs(commands: list[Command]) -> list[list[str]]:
    return [list(c.argv) for c in commands]


def test_finder_reads_shell_operators_substitutions_and_quotes() -> None:
    text = (
        'cd x && erase-tune start --space "my space.yaml" --storage "$(cat url)" | tee log; '
        "PGPASSWORD=${PW} erase-tune status --study ${STUDY}\n"
        "erase-tune export --study a -o best.yaml > out  # erase-tune is not run here\n"
    )
    assert argvs(shell_commands(text, "t")) == [
        ["start", "--space", "my space.yaml", "--storage", "SUBSTITUTED"],
        ["status", "--study", "SUBSTITUTED"],
        ["export", "--study", "a", "-o", "best.yaml"],
    ]


def test_finder_reads_inside_sh_c_and_exec_forms() -> None:
    assert argvs(shell_commands("bash -c 'erase-tune db upgrade && erase-tune start --space s.yaml'", "t")) == [
        ["db", "upgrade"], ["start", "--space", "s.yaml"],
    ]
    assert argvs(exec_form(["erase-tune", "dashboard", "--port", 8080], "t")) == [["dashboard", "--port", "8080"]]
    assert argvs(exec_form(["sh", "-c", "erase-tune db upgrade"], "t")) == [["db", "upgrade"]]


def test_finder_tells_commands_from_names() -> None:
    text = (
        'pip install "erase-tune[tune]" && pip install erase-tune\n'
        "docker build -t erase-tune:0.1.0 . && kubectl logs job/erase-tune-ctr\n"
        "kubectl wait raycluster/erase-tune --timeout=1m\n"
        ".venv/bin/erase-tune status\n"
    )
    assert argvs(shell_commands(text, "t")) == [["status"]]
    assert argvs(shell_commands("erase-tune is installed from the wheel", "t", prose=True)) == []
    assert argvs(shell_commands("run: erase-tune db upgrade", "t", prose=True)) == [["db", "upgrade"]]


def test_finder_reads_markdown_code_and_inline_code(tmp_path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Run `erase-tune db upgrade` once; the `erase-tune` tool.\n\n"
        "```sh\nerase-tune start --space a.yaml \\\n    --study b\n```\n"
    )
    assert sorted(argvs(markdown_commands(page))) == [["db", "upgrade"], ["start", "--space", "a.yaml", "--study", "b"]]


def test_parser_check_catches_a_bad_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["status", "--no-such-flag"])
    assert e.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err
