"""The cert-manager Certificates the repository ships (every `kind: Certificate` under
deploy/, today deploy/kubernetes/templates/certificate-tls.yaml and
deploy/kubernetes/templates/certificate-shards-tls.yaml), checked offline against
cert-manager's `cert-manager.io/v1` API: nothing applies them in CI, and Kubernetes'
own schemas (kubernetes-validate) do not know cert-manager's kinds, so a misspelt field
(`dnsName`, `usage`) would pass every other test and be refused, or silently dropped,
only in the operator's cluster.

CERTIFICATE_SCHEMA below is written by hand from cert-manager's v1 API (the Certificate
type and its documented fields), not fetched or copied from cert-manager's CRD: it covers
every field of the spec, with its type, and rejects any other. `schema_errors` is a small
recursive checker of it; `semantic_errors` adds what cert-manager's admission webhook
refuses beyond the schema (no name to certify, durations out of order) and what this
repository's mutual TLS needs (tests/integration/test_prod_tls.py and
tests/integration/test_shards_tls.py issue certificates from these templates)."""

from __future__ import annotations

import copy
import difflib
import ipaddress
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.unit.deploy.conftest import DEPLOY, ROOT, TEMPLATES, documents

# cert-manager's KeyUsage enum (the `usages` of a Certificate), spelt as the API spells it.
KEY_USAGES = (
    "signing",
    "digital signature",
    "content commitment",
    "key encipherment",
    "key agreement",
    "data encipherment",
    "cert sign",
    "crl sign",
    "encipher only",
    "decipher only",
    "any",
    "server auth",
    "client auth",
    "code signing",
    "email protection",
    "s/mime",
    "ipsec end system",
    "ipsec tunnel",
    "ipsec user",
    "timestamping",
    "ocsp signing",
    "microsoft sgc",
    "netscape sgc",
)

STRING: dict[str, Any] = {"type": "string"}
STRINGS: dict[str, Any] = {"type": "array", "items": STRING}
STRING_MAP: dict[str, Any] = {"type": "object", "additionalProperties": STRING}
BOOLEAN: dict[str, Any] = {"type": "boolean"}
INTEGER: dict[str, Any] = {"type": "integer"}
DURATION: dict[str, Any] = {"type": "string", "format": "duration"}


def closed(properties: dict[str, Any], *required: str) -> dict[str, Any]:
    """An object with exactly these fields: any other is an error, as a misspelling is."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


def one_of(values: tuple[Any, ...], what: str) -> dict[str, Any]:
    return {"enum": list(values), "description": what}


SECRET_KEY_SELECTOR = closed({"name": STRING, "key": STRING}, "name")
NAME_LISTS = closed(
    {"dnsDomains": STRINGS, "ipRanges": STRINGS, "emailAddresses": STRINGS, "uriDomains": STRINGS}
)

# cert-manager.io/v1 Certificate, from cert-manager's v1 API (not fetched: see the docstring).
CERTIFICATE_SCHEMA = closed(
    {
        "apiVersion": {"const": "cert-manager.io/v1"},
        "kind": {"const": "Certificate"},
        # The ObjectMeta fields a template for `kubectl apply` sets; the API server fills
        # in the rest, so any other here is a mistake too.
        "metadata": closed(
            {"name": STRING, "namespace": STRING, "labels": STRING_MAP, "annotations": STRING_MAP},
            "name",
        ),
        "spec": closed(
            {
                "secretName": STRING,
                "issuerRef": closed({"name": STRING, "kind": STRING, "group": STRING}, "name"),
                "commonName": STRING,
                "literalSubject": STRING,
                "dnsNames": STRINGS,
                "ipAddresses": {"type": "array", "items": {"type": "string", "format": "ip"}},
                "uris": STRINGS,
                "emailAddresses": STRINGS,
                "otherNames": {
                    "type": "array",
                    "items": closed({"oid": STRING, "utf8Value": STRING}),
                },
                "duration": DURATION,
                "renewBefore": DURATION,
                "renewBeforePercentage": INTEGER,
                "usages": {
                    "type": "array",
                    "items": one_of(KEY_USAGES, "a cert-manager key usage"),
                },
                "encodeUsagesInRequest": BOOLEAN,
                "isCA": BOOLEAN,
                "privateKey": closed(
                    {
                        "algorithm": one_of(("RSA", "ECDSA", "Ed25519"), "a key algorithm"),
                        "size": INTEGER,
                        "encoding": one_of(("PKCS1", "PKCS8"), "a key encoding"),
                        "rotationPolicy": one_of(("Never", "Always"), "a rotation policy"),
                    }
                ),
                "subject": closed(
                    {
                        "organizations": STRINGS,
                        "countries": STRINGS,
                        "organizationalUnits": STRINGS,
                        "localities": STRINGS,
                        "provinces": STRINGS,
                        "streetAddresses": STRINGS,
                        "postalCodes": STRINGS,
                        "serialNumber": STRING,
                    }
                ),
                "secretTemplate": closed({"annotations": STRING_MAP, "labels": STRING_MAP}),
                "revisionHistoryLimit": INTEGER,
                "keystores": closed(
                    {
                        "jks": closed(
                            {
                                "create": BOOLEAN,
                                "passwordSecretRef": SECRET_KEY_SELECTOR,
                                "password": STRING,
                                "alias": STRING,
                            },
                            "create",
                        ),
                        "pkcs12": closed(
                            {
                                "create": BOOLEAN,
                                "passwordSecretRef": SECRET_KEY_SELECTOR,
                                "password": STRING,
                                "profile": one_of(
                                    ("LegacyRC2", "LegacyDES", "Modern2023"), "a PKCS#12 profile"
                                ),
                            },
                            "create",
                        ),
                    }
                ),
                "additionalOutputFormats": {
                    "type": "array",
                    "items": closed(
                        {"type": one_of(("DER", "CombinedPEM"), "an output format")}, "type"
                    ),
                },
                "nameConstraints": closed(
                    {"critical": BOOLEAN, "permitted": NAME_LISTS, "excluded": NAME_LISTS}
                ),
            },
            "secretName",
            "issuerRef",
        ),
    },
    "apiVersion",
    "kind",
    "metadata",
    "spec",
)

# Go's time.ParseDuration, which reads cert-manager's durations: a sequence of decimal
# numbers each with a unit, no days ("90d" is refused), or a bare 0.
GO_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
GO_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1,
    "m": 60,
    "h": 3600,
}


def go_duration_seconds(text: str) -> float | None:
    """Seconds of a Go duration, or None where Go would refuse it."""
    sign, body = (-1, text[1:]) if text[:1] == "-" else (1, text.removeprefix("+"))
    if body == "0":
        return 0.0
    parts = list(GO_DURATION_PART.finditer(body))
    if not parts or "".join(p.group(0) for p in parts) != body:
        return None
    return sign * sum(float(p.group(1)) * GO_UNIT_SECONDS[p.group(2)] for p in parts)


def is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
}
FORMATS: dict[str, tuple[Callable[[str], bool], str]] = {
    "duration": (lambda v: go_duration_seconds(v) is not None, "a Go duration like '2160h'"),
    "ip": (is_ip, "an IP address"),
}


def schema_errors(value: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """What in `value` breaks `schema`, one line each, led by the offending path
    (`spec.usages[2]: 'sever auth' is not a cert-manager key usage`)."""
    where = path or "<document>"
    if "const" in schema and value != schema["const"]:
        return [f"{where}: {value!r} is not {schema['const']!r}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} is not {schema['description']}"]
    kind = schema.get("type")
    if kind is not None and not JSON_TYPES[kind](value):
        return [f"{where}: expected {kind}, got {type(value).__name__} {value!r}"]
    if "format" in schema:
        valid, what = FORMATS[schema["format"]]
        if not valid(value):
            return [f"{where}: {value!r} is not {what}"]
    errors: list[str] = []
    if kind == "array":
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{path}[{i}]")
    if kind == "object":
        known = schema.get("properties", {})
        for name in schema.get("required", []):
            if name not in value:
                errors.append(f"{path + '.' if path else ''}{name}: required field missing")
        for name, item in value.items():
            at = f"{path}.{name}" if path else str(name)
            if name in known:
                errors += schema_errors(item, known[name], at)
            elif schema.get("additionalProperties") is False:
                guess = difflib.get_close_matches(str(name), known, n=1)
                hint = f" (did you mean {guess[0]!r}?)" if guess else ""
                errors.append(f"{at}: unknown field{hint}")
            elif isinstance(schema.get("additionalProperties"), dict):
                errors += schema_errors(item, schema["additionalProperties"], at)
    return errors


# cert-manager's webhook: a certificate needs at least one of these to name its subject.
SUBJECT_NAMES = (
    "commonName",
    "literalSubject",
    "dnsNames",
    "ipAddresses",
    "uris",
    "emailAddresses",
    "otherNames",
)
# cert-manager's defaults and bounds (pkg/apis/certmanager/v1 in cert-manager's tree):
# 90 days when duration is unset, at least an hour, renewBefore at least 5 minutes.
DEFAULT_DURATION = "2160h"
MINIMUM_DURATION_S = 3600
MINIMUM_RENEW_BEFORE_S = 300
ECDSA_SIZES = (256, 384, 521)
# The Secret the controller (or each shard) serves mutual TLS from; the admin CLI in its pod
# presents the same files as its client certificate, so it must be good for both ends, as
# tests/integration/test_prod_tls.py asserts of the one controller's template.
MUTUAL_TLS_SECRET = "rebalancer-tls"


def semantic_errors(doc: dict[str, Any]) -> list[str]:
    """What cert-manager refuses, or this repository cannot use, in a Certificate the schema
    accepts."""
    spec = doc["spec"]
    errors = []
    if not any(spec.get(name) for name in SUBJECT_NAMES):
        errors.append(f"spec: sets none of {', '.join(SUBJECT_NAMES)}")
    duration = go_duration_seconds(spec.get("duration", DEFAULT_DURATION))
    assert duration is not None, "the schema checks the format first"
    if duration < MINIMUM_DURATION_S:
        errors.append(f"spec.duration: {spec['duration']!r} is under cert-manager's 1h")
    if "renewBefore" in spec:
        renew = go_duration_seconds(spec["renewBefore"])
        assert renew is not None, "the schema checks the format first"
        if renew >= duration:
            errors.append(
                f"spec.renewBefore: {spec['renewBefore']!r} is not shorter than the duration "
                f"{spec.get('duration', DEFAULT_DURATION)!r}"
            )
        if renew < MINIMUM_RENEW_BEFORE_S:
            errors.append(f"spec.renewBefore: {spec['renewBefore']!r} is under cert-manager's 5m")
    key = spec.get("privateKey", {})
    if key.get("algorithm") == "ECDSA" and key.get("size", 256) not in ECDSA_SIZES:
        errors.append(f"spec.privateKey.size: {key['size']} is not an ECDSA size {ECDSA_SIZES}")
    if key.get("algorithm", "RSA") == "RSA" and not 2048 <= key.get("size", 2048) <= 8192:
        errors.append(f"spec.privateKey.size: {key['size']} is not an RSA size (2048-8192)")
    if spec.get("secretName") == MUTUAL_TLS_SECRET:
        missing = {"server auth", "client auth"} - set(spec.get("usages", []))
        if missing:
            errors.append(f"spec.usages: mutual TLS needs {sorted(missing)} too")
    return errors


def all_errors(doc: dict[str, Any]) -> list[str]:
    errors = schema_errors(doc, CERTIFICATE_SCHEMA)
    return errors or semantic_errors(doc)  # the semantics read fields the schema vouched for


def certificate_files() -> list[Path]:
    """Every YAML file under deploy/ with a cert-manager Certificate in it."""
    paths = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    return [p for p in paths if any(is_certificate(d) for d in documents(p))]


def is_certificate(doc: Any) -> bool:
    return (
        isinstance(doc, dict)
        and doc.get("kind") == "Certificate"
        and str(doc.get("apiVersion", "")).startswith("cert-manager.io/")
    )


def certificates(path: Path) -> list[dict[str, Any]]:
    return [d for d in documents(path) if is_certificate(d)]


CERTIFICATE_FILES = certificate_files()
# The templates the TLS integration tests issue from: found, whatever else is.
KNOWN = {TEMPLATES / "certificate-tls.yaml", TEMPLATES / "certificate-shards-tls.yaml"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_search_finds_the_known_templates() -> None:
    assert KNOWN <= set(CERTIFICATE_FILES), [rel(p) for p in CERTIFICATE_FILES]


@pytest.mark.parametrize("path", CERTIFICATE_FILES, ids=rel)
def test_the_certificate_is_valid_for_cert_manager(path: Path) -> None:
    for doc in certificates(path):
        assert schema_errors(doc, CERTIFICATE_SCHEMA) == [], rel(path)
        assert semantic_errors(doc) == [], rel(path)


@pytest.mark.parametrize("path", CERTIFICATE_FILES, ids=rel)
def test_the_certificate_is_one_for_mutual_tls(path: Path) -> None:
    """Both ends of mutual TLS, from the Secret the controller serves, with durations cert-
    manager accepts: renewal inside the certificate's life."""
    for doc in certificates(path):
        spec = doc["spec"]
        assert spec["secretName"] == MUTUAL_TLS_SECRET
        assert {"server auth", "client auth"} <= set(spec["usages"])
        duration = go_duration_seconds(spec["duration"])
        renew = go_duration_seconds(spec["renewBefore"])
        assert duration is not None and renew is not None and 0 < renew < duration


def test_every_field_of_the_schema_is_accepted() -> None:
    """The schema is no stricter than cert-manager: a Certificate setting the optional
    fields, as cert-manager's documentation uses them, passes."""
    doc = {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Certificate",
        "metadata": {"name": "full", "annotations": {"a": "b"}},
        "spec": {
            "secretName": "full-tls",
            "secretTemplate": {"annotations": {"x": "y"}, "labels": {"z": "w"}},
            "commonName": "example.com",
            "dnsNames": ["example.com"],
            "ipAddresses": ["10.0.0.1", "::1"],
            "uris": ["spiffe://cluster.local/ns/x/sa/y"],
            "emailAddresses": ["ops@example.com"],
            "duration": "720h0m0s",
            "renewBefore": "1h30m",
            "usages": list(KEY_USAGES),
            "isCA": False,
            "privateKey": {
                "algorithm": "RSA",
                "size": 4096,
                "encoding": "PKCS8",
                "rotationPolicy": "Never",
            },
            "subject": {"organizations": ["Example"], "countries": ["NL"]},
            "revisionHistoryLimit": 3,
            "keystores": {
                "pkcs12": {
                    "create": True,
                    "passwordSecretRef": {"name": "p12", "key": "password"},
                    "profile": "Modern2023",
                }
            },
            "additionalOutputFormats": [{"type": "CombinedPEM"}],
            "issuerRef": {"name": "ca", "kind": "ClusterIssuer", "group": "cert-manager.io"},
        },
    }
    assert all_errors(doc) == []


def rename(spec: dict[str, Any], old: str, new: str) -> None:
    spec[new] = spec.pop(old)


def misspell_usage(spec: dict[str, Any]) -> None:
    spec["usages"][0] = "sever auth"


def drop_names(spec: dict[str, Any]) -> None:
    del spec["dnsNames"], spec["ipAddresses"]


# (what is done to a real template's spec, the path an error must lead with)
MUTATIONS: dict[str, tuple[Callable[[dict[str, Any]], object], str]] = {
    "dnsNames as dnsName": (lambda s: rename(s, "dnsNames", "dnsName"), "spec.dnsName:"),
    "usages as usage": (lambda s: rename(s, "usages", "usage"), "spec.usage:"),
    "a misspelt usage": (misspell_usage, "spec.usages[0]:"),
    "no secretName": (lambda s: s.pop("secretName"), "spec.secretName:"),
    "issuerRef without name": (lambda s: s["issuerRef"].pop("name"), "spec.issuerRef.name:"),
    "duration in days": (lambda s: s.update(duration="90d"), "spec.duration:"),
    "an unknown key algorithm": (
        lambda s: s["privateKey"].update(algorithm="EC"),
        "spec.privateKey.algorithm:",
    ),
    "an IP as text": (lambda s: s.update(ipAddresses=["localhost"]), "spec.ipAddresses[0]:"),
    "renewal after expiry": (lambda s: s.update(renewBefore="2161h"), "spec.renewBefore:"),
    "no client auth": (lambda s: s["usages"].remove("client auth"), "spec.usages:"),
    "no name at all": (drop_names, "spec: sets none of"),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_defect_is_reported_at_its_field(mutation: str) -> None:
    (doc,) = certificates(TEMPLATES / "certificate-tls.yaml")
    assert all_errors(doc) == []
    mutate, where = MUTATIONS[mutation]
    broken = copy.deepcopy(doc)
    mutate(broken["spec"])
    errors = all_errors(broken)
    assert any(e.startswith(where) for e in errors), errors


def test_an_error_says_what_is_wrong() -> None:
    (doc,) = certificates(TEMPLATES / "certificate-tls.yaml")
    broken = copy.deepcopy(doc)
    broken["spec"]["usages"][2] = "sever auth"
    rename(broken["spec"], "dnsNames", "dnsName")
    broken["spec"]["duration"] = "90d"
    assert sorted(schema_errors(broken, CERTIFICATE_SCHEMA)) == [
        "spec.dnsName: unknown field (did you mean 'dnsNames'?)",
        "spec.duration: '90d' is not a Go duration like '2160h'",
        "spec.usages[2]: 'sever auth' is not a cert-manager key usage",
    ]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("2160h", 2160 * 3600), ("720h0m0s", 720 * 3600), ("1h30m", 5400), ("1.5h", 5400),
     ("0", 0), ("300ms", 0.3), ("90d", None), ("h", None), ("", None), ("10", None)],
)  # fmt: skip
def test_go_durations_parse_as_go_does(text: str, seconds: float | None) -> None:
    parsed = go_duration_seconds(text)
    assert parsed is None if seconds is None else parsed == pytest.approx(seconds)
