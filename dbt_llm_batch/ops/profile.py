"""Which DuckDB file and schema a dbt project writes, read from its profile as dbt reads it, for the
operator commands run without `--database` (`dbt-llm-batch status`).

dbt's rules, kept: the profile is the one dbt_project.yml names; profiles.yml is found in
`--profiles-dir`, else $DBT_PROFILES_DIR, else the project directory, else ~/.dbt; the output is
`--target`, else $DBT_TARGET, else the profile's `target`. `{{ env_var('NAME', 'default') }}` in the
profile is rendered as dbt renders it. A relative `path` is taken from the project directory (where
dbt is run). This module reads YAML and renders Jinja; it does not import dbt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import jinja2
import yaml  # type: ignore[import-untyped]

from dbt_llm_batch.errors import ConfigError


@dataclass(frozen=True)
class Warehouse:
    database: str  # the DuckDB file
    schema: str  # the target's schema (where the ledger is, unless llm_ledger_schema moved it)


def _env_var(name: str, default: str | None = None) -> str:
    if name in os.environ:
        return os.environ[name]
    if default is None:
        raise ConfigError(f"the dbt profile reads env_var('{name}'), which is not set: set it, or pass --database")
    return default


def _render(value):
    if isinstance(value, str) and "{{" in value:
        return jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(value).render(env_var=_env_var)
    return value


def profiles_file(project_dir: Path, profiles_dir: str | None) -> Path:
    candidates = [profiles_dir, os.environ.get("DBT_PROFILES_DIR"), str(project_dir), str(Path.home() / ".dbt")]
    for folder in [c for c in candidates if c]:
        if (Path(folder) / "profiles.yml").is_file():
            return Path(folder) / "profiles.yml"
    raise ConfigError(
        f"no profiles.yml in {profiles_dir or os.environ.get('DBT_PROFILES_DIR') or project_dir} or ~/.dbt: "
        "pass --profiles-dir, or the DuckDB file with --database"
    )


def warehouse(project_dir: str = ".", profiles_dir: str | None = None, target: str | None = None) -> Warehouse:
    """The DuckDB file and schema of the project's target; ConfigError saying what to pass otherwise."""
    project = Path(project_dir)
    try:
        profile_name = yaml.safe_load((project / "dbt_project.yml").read_text())["profile"]
    except (OSError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"no dbt project with a profile at {project.resolve()} ({exc}): pass --project-dir, or --database"
        ) from None
    path = profiles_file(project, profiles_dir)
    profile = (yaml.safe_load(path.read_text()) or {}).get(profile_name)
    if not isinstance(profile, dict):
        raise ConfigError(f"{path} has no profile '{profile_name}' (dbt_project.yml's `profile`)")
    name = target or os.environ.get("DBT_TARGET") or _render(profile.get("target"))
    output = (profile.get("outputs") or {}).get(name)
    if not isinstance(output, dict):
        raise ConfigError(f"profile '{profile_name}' in {path} has no target '{name}'")
    if _render(output.get("type")) != "duckdb":
        raise ConfigError(f"target '{name}' of profile '{profile_name}' is not a duckdb target: pass --database")
    database = _render(output.get("path") or "")
    if not database or database == ":memory:":
        raise ConfigError(f"target '{name}' of profile '{profile_name}' has no DuckDB file (`path`): pass --database")
    if not os.path.isabs(database):
        database = str(project / database)
    return Warehouse(database, str(_render(output.get("schema") or "main")))


# The ledger a command reads, as every command that reads one takes it: `--database` (and `--schema`),
# else the dbt profile's target, found with `--project-dir`, `--profiles-dir` and `--target` as dbt does.
def add_ledger_options(parser, schema_default: str) -> None:
    """Add the ledger's options to a subcommand; `schema_default` says in its help what no --schema means."""
    parser.add_argument("--database", help="path of the DuckDB file (default: the dbt profile's, as dbt reads it)")
    parser.add_argument("--schema", default=None, help=f"schema holding the ledger tables (default: {schema_default})")
    parser.add_argument("--project-dir", default=".", help="the dbt project whose profile names the file (default: .)")
    parser.add_argument("--profiles-dir", default=None, help="where profiles.yml is (default: as dbt looks for it)")
    parser.add_argument("--target", default=None, help="the profile's target (default: the profile's own)")


def ledger_location(args, schema_from_profile: bool = True) -> tuple[str, str | None]:
    """(DuckDB file, schema) of the options add_ledger_options added: `--database` as given, else the
    profile's file; `--schema` as given, else the profile's schema when the file came from the profile
    and `schema_from_profile` (None otherwise: the command's own default). ConfigError if no profile
    names a DuckDB file."""
    if args.database is not None:
        return args.database, args.schema
    found = warehouse(args.project_dir, args.profiles_dir, args.target)
    return found.database, args.schema or (found.schema if schema_from_profile else None)
