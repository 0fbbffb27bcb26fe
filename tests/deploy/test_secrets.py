"""Nothing secret is written in deploy/: no password in a URL, no literal value for a
password/token/secret variable or key, no Secret object with data, no key material, no
token-like strings. Passwords reach containers only from a Secret (secretKeyRef) or the
git-ignored env files compose reads.

The scanner is tested on planted secrets first: a scanner that flags nothing would pass
every file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.deployfiles import deploy_files, load_docs, rel

SECRET_NAME = re.compile(r"pass(word|wd)?|pwd|token|secret|api[_-]?key|private[_-]?key", re.IGNORECASE)
# Keys that name or point at a secret rather than hold one.
REFERENCE_KEY = re.compile(r"(name|ref|file|path|mode)$", re.IGNORECASE)

_URL_PASSWORD = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s:@'\"`]+:[^/\s@'\"`]+@", re.IGNORECASE)
_PRIVATE_KEY = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")
# NAME=value or NAME: value for an upper-case variable, and --password=value style flags.
_ASSIGNMENT = re.compile(
    r"\b(?P<name>[A-Z][A-Z0-9_]*(?:PASSWORD|PASSWD|PWD|TOKEN|SECRET|API_KEY)[A-Z0-9_]*)\s*(?:=|:\s)\s*[\"']?(?P<value>[^\s\"'`;]*)"
    r"|--(?P<flag>[\w-]*(?:password|token|secret)[\w-]*)[= ](?P<flagvalue>[^\s\"'`;]+)"
)
_TOKEN_LIKE = re.compile(r"(?<![\w:])(?:[0-9a-f]{32,}|[A-Za-z0-9+/]{40,}={0,2})(?![\w])")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def _literal(value: str) -> bool:
    """A value written out, as opposed to a reference: $VAR, $(cmd), ${VAR}, printf's %s,
    a placeholder left empty."""
    return bool(value) and not value.startswith(("$", "%s"))


def text_findings(text: str) -> list[str]:
    found = []
    for m in _URL_PASSWORD.finditer(text):
        found.append(f"password in URL: {m.group(0)}")
    if _PRIVATE_KEY.search(text):
        found.append("private key block")
    for m in _ASSIGNMENT.finditer(text):
        if m.group("name") and _literal(m.group("value")):
            found.append(f"{m.group('name')} set to a literal")
        if m.group("flag") and _literal(m.group("flagvalue")):
            found.append(f"--{m.group('flag')} given a literal")
    for m in _TOKEN_LIKE.finditer(_DIGEST.sub("", text)):
        found.append(f"token-like string {m.group(0)[:8]}...")
    return found


def yaml_findings(node: Any, path: str = "") -> list[str]:
    found = []
    if isinstance(node, dict):
        if node.get("kind") == "Secret" and (node.get("data") or node.get("stringData")):
            found.append(f"{path or 'document'}: a Secret with data")
        # A container env entry: {name: PGPASSWORD, value: ...} must be a valueFrom.
        if isinstance(node.get("name"), str) and "value" in node and SECRET_NAME.search(node["name"]):
            if not REFERENCE_KEY.search(node["name"]) and node["value"] not in (None, ""):
                found.append(f"{path}: env {node['name']} has a literal value")
        for key, value in node.items():
            where = f"{path}.{key}" if path else str(key)
            if (isinstance(key, str) and SECRET_NAME.search(key) and not REFERENCE_KEY.search(key)
                    and isinstance(value, (str, int, float)) and not isinstance(value, bool)
                    and _literal(str(value))):
                found.append(f"{where}: literal value")
            found.extend(yaml_findings(value, where))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            if isinstance(value, str):  # compose's list form: KEY=VALUE
                key, sep, val = value.partition("=")
                if sep and SECRET_NAME.search(key) and not REFERENCE_KEY.search(key) and _literal(val):
                    found.append(f"{path}[{i}]: {key} set to a literal")
            found.extend(yaml_findings(value, f"{path}[{i}]"))
    return found


def findings(path: Path) -> list[str]:
    found = text_findings(path.read_text())
    if path.suffix in (".yaml", ".yml"):
        for doc in load_docs(path):
            found.extend(yaml_findings(doc))
    return found


@pytest.mark.parametrize("path", deploy_files(), ids=rel)
def test_no_secret_in_deploy_file(path: Path) -> None:
    assert findings(path) == [], rel(path)


# -- the scanner, on planted secrets -------------------------------------------------------------

PLANTED_TEXT = [
    "--storage postgresql+psycopg://erase_tune:hunter2@db:5432/erase_tune",
    "export PGPASSWORD=hunter2",
    "PGPASSWORD='hunter2' erase-tune status",
    "POSTGRES_PASSWORD: hunter2",
    "ray start --redis-password=hunter2",
    "RAY_AUTH_TOKEN=0f3b8c1d2e4a5b6c7d8e9f00112233445566778899aabbcc",
    "-----BEGIN OPENSSH PRIVATE KEY-----",
    "token: 9b2c4e6a8d0f1b3d5f7a9c1e3b5d7f9a",
]
CLEAN_TEXT = [
    "postgresql+psycopg://erase_tune@erase-tune-postgres:5432/erase_tune",
    'PGPASSWORD="$(cat /run/secrets/pw)" erase-tune status',
    "printf 'POSTGRES_PASSWORD=%s\\nPGPASSWORD=%s\\n' \"$pw\" \"$pw\" > deploy/db.env",
    'export RAY_AUTH_TOKEN="$(kubectl get secret erase-tune -o jsonpath=\'{.data.auth_token}\' | base64 -d)"',
    "image: postgres:17.6@sha256:" + "0" * 64,
    "ssh -L 8080:127.0.0.1:8080 workstation",
]
PLANTED_YAML = [
    {"env": [{"name": "PGPASSWORD", "value": "hunter2"}]},
    {"services": {"db": {"environment": {"POSTGRES_PASSWORD": "hunter2"}}}},
    {"services": {"db": {"environment": ["POSTGRES_PASSWORD=hunter2"]}}},
    {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}, "stringData": {"password": "change-me"}},
    {"auth": {"password": "hunter2"}},
]
CLEAN_YAML = [
    {"env": [{"name": "PGPASSWORD", "valueFrom": {"secretKeyRef": {"name": "erase-tune-db", "key": "password"}}}]},
    {"authOptions": {"mode": "token", "secretName": "ray-token"}},
    {"environment": {"RAY_AUTH_MODE": "token"}},
]


@pytest.mark.parametrize("text", PLANTED_TEXT)
def test_scanner_finds_planted_text(text: str) -> None:
    assert text_findings(text)


@pytest.mark.parametrize("text", CLEAN_TEXT)
def test_scanner_passes_references(text: str) -> None:
    assert text_findings(text) == []


@pytest.mark.parametrize("doc", PLANTED_YAML)
def test_scanner_finds_planted_yaml(doc: Any) -> None:
    assert yaml_findings(yaml.safe_load(yaml.safe_dump(doc)))


@pytest.mark.parametrize("doc", CLEAN_YAML)
def test_scanner_passes_yaml_references(doc: Any) -> None:
    assert yaml_findings(doc) == []
