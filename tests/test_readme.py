"""The README's first two commands are the contract with a new user; CI must run the second."""
import re

from tests.conftest import REPO

VENV = 'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev]" && '


def readme() -> str:
    return open(f"{REPO}/README.md").read()


def readme_commands() -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", readme(), re.S)][:2]


def test_ci_runs_exactly_the_readme_test_command():
    main_job, tests = readme_commands()
    assert "pytest" in tests and "kvrt" in main_job
    ci = open(f"{REPO}/.ci/run").read().splitlines()
    assert tests in ci


def test_the_readme_names_the_fast_lane_as_the_development_guide_gives_it():
    lane = '`python -m pytest -m "not e2e" -n 2`'
    assert lane in readme().replace("\n", " ")
    assert lane in open(f"{REPO}/docs/development.md").read()


def test_quick_start_makes_a_venv_first_and_names_the_debian_packages_ci_installs():
    """A distribution's Python refuses `pip install` outside a virtual environment (PEP 668).
    The build needs no system headers but Python's: the prefix cache's C loops take xxhash
    from the `xxhash` package, not from a `-dev` package."""
    for command in readme_commands():
        assert command.startswith(VENV)
    ci = open(f"{REPO}/.ci/run").read()
    ci_packages = re.search(r"apt-get install -y ([^\n]+)", ci).group(1).split()
    named = re.search(r"`sudo apt-get install -y ([^`]+)`", readme()).group(1).split()
    assert ci_packages == named and "python3-venv" in named
    assert [p for p in named if p.endswith("-dev")] == ["python3-dev"]
    assert ".venv/" in open(f"{REPO}/.gitignore").read().split()
