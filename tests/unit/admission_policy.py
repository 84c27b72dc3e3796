"""A ValidatingAdmissionPolicy from deploy/ evaluated the way kube-apiserver evaluates it, with
cel-python, on AdmissionReview-style input.

What the API server does (k8s.io/apiserver, admission/plugin/policy/validating) and this does too:

- ``matchConstraints.resourceRules`` select by API group, version, resource[/subresource] and
  operation; then every ``matchConditions`` expression must be true, or the policy does not apply;
- ``variables`` are evaluated in order, each one seeing the earlier ones as ``variables.<name>``;
- every ``validations`` expression must be true; a false one refuses the request with its
  ``messageExpression`` (falling back to ``message``); an expression that cannot be evaluated
  refuses it too (``failurePolicy: Fail``);
- ``object`` and ``oldObject`` are the objects as plain JSON maps (the API server declares them
  ``dyn`` and hands over the unstructured object), ``request`` is the AdmissionRequest with empty
  ``omitempty`` fields left out (``userInfo.extra`` of a token without extras, ``subResource``).

Where this differs: the API server type-checks at creation and evaluates variables lazily; here
variables are evaluated up front (an error in one that no validation uses would count here). No
cost limits. cel-python has CEL's standard library, not Kubernetes' extension libraries: of
those the policy uses only the strings library's ``join``, defined here as a custom function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import celpy
import yaml
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError, CELFunction

ROOT = Path(__file__).resolve().parents[2]
NODE_SCOPE_POLICY = ROOT / "deploy" / "base" / "node-scope-policy.yaml"
AGENT_USER = "system:serviceaccount:kube-system:vcuda-agent"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
_RESOURCES = {"Pod": "pods", "Node": "nodes"}

Doc = dict[str, Any]


def _join(items: celtypes.ListType, separator: celtypes.StringType | None = None) -> celtypes.StringType:
    """Kubernetes' strings library: ``<list<string>>.join([separator])``."""
    return celtypes.StringType(str(separator or "").join(str(item) for item in items))


_FUNCTIONS: dict[str, CELFunction] = {"join": _join}


@dataclass(frozen=True)
class Decision:
    matched: bool  # the policy applies to the request (rules and matchConditions)
    refusals: tuple[str, ...] = ()  # messages of the validations that were false
    errors: tuple[str, ...] = ()  # expressions that could not be evaluated (refused: failurePolicy Fail)

    @property
    def allowed(self) -> bool:
        return not self.matched or not (self.refusals or self.errors)


@dataclass(frozen=True)
class _Expression:
    where: str  # e.g. "validations[2].expression", for error messages
    text: str
    program: celpy.Runner


class AdmissionPolicy:
    """One ValidatingAdmissionPolicy document; ``review`` answers one UPDATE/CREATE/DELETE."""

    def __init__(self, doc: Doc) -> None:
        assert doc["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert doc["kind"] == "ValidatingAdmissionPolicy"
        self.doc = doc
        spec = doc["spec"]
        # An evaluation error counts as a refusal below: that is failurePolicy Fail (the default).
        assert spec.get("failurePolicy", "Fail") == "Fail", "only failurePolicy: Fail is modelled"
        self.rules: list[Doc] = spec["matchConstraints"]["resourceRules"]
        env = celpy.Environment()

        def compiled(where: str, text: str) -> _Expression:
            # A parse error here is a policy the API server would refuse to create.
            return _Expression(where, text, env.program(env.compile(text), functions=_FUNCTIONS))

        self.conditions = [
            compiled(f"matchConditions[{i}]", c["expression"])
            for i, c in enumerate(spec.get("matchConditions", []))
        ]
        self.variables = [
            (v["name"], compiled(f"variables.{v['name']}", v["expression"]))
            for v in spec.get("variables", [])
        ]
        self.validations: list[tuple[_Expression, _Expression | None, str]] = [
            (
                compiled(f"validations[{i}].expression", v["expression"]),
                compiled(f"validations[{i}].messageExpression", v["messageExpression"])
                if "messageExpression" in v
                else None,
                v.get("message", f"failed expression: {v['expression']}"),
            )
            for i, v in enumerate(spec["validations"])
        ]

    def expressions(self) -> list[str]:
        found = [c.text for c in self.conditions] + [v.text for _, v in self.variables]
        for check, message, _ in self.validations:
            found += [check.text] + ([message.text] if message else [])
        return found

    def selects(self, request: Mapping[str, Any]) -> bool:
        """matchConstraints.resourceRules against the request's resource and operation."""
        resource = request["resource"]
        sub = request.get("subResource", "")
        name = f"{resource['resource']}/{sub}" if sub else resource["resource"]
        wanted = {name, "*/*", f"{resource['resource']}/*" if sub else "*", f"*/{sub}" if sub else "*"}
        return any(
            _has(rule["apiGroups"], resource["group"])
            and _has(rule["apiVersions"], resource["version"])
            and _has(rule["operations"], request["operation"])
            and bool(wanted & set(rule["resources"]))
            for rule in self.rules
        )

    def review(self, request: Mapping[str, Any], obj: Doc | None, old: Doc | None) -> Decision:
        if not self.selects(request):
            return Decision(matched=False)
        activation: dict[str, Any] = {
            "request": json_to_cel(dict(request)),
            "object": json_to_cel(obj),
            "oldObject": json_to_cel(old),
        }
        errors: list[str] = []
        for condition in self.conditions:
            matched = _evaluate(condition, activation, errors)
            if matched is None:
                return Decision(matched=True, errors=tuple(errors))  # failurePolicy Fail
            if not _is_true(matched):
                return Decision(matched=False)
        variables: dict[celtypes.StringType, Any] = {}
        for name, expression in self.variables:
            activation["variables"] = celtypes.MapType(variables)
            value = _evaluate(expression, activation, errors)
            if value is not None:
                variables[celtypes.StringType(name)] = value
        activation["variables"] = celtypes.MapType(variables)
        refusals: list[str] = []
        for check, message_expression, message in self.validations:
            result = _evaluate(check, activation, errors)
            if result is None or _is_true(result):
                continue
            text = _evaluate(message_expression, activation, []) if message_expression else None
            # An empty or failing messageExpression falls back to message, as on the API server.
            # (cel-python's string concatenation gives a plain str, not a StringType.)
            refusals.append(text if isinstance(text, str) and text else message.strip())
        return Decision(matched=True, refusals=tuple(refusals), errors=tuple(errors))


def _has(values: Sequence[str], value: str) -> bool:
    return "*" in values or value in values


def _is_true(value: Any) -> bool:
    return isinstance(value, celtypes.BoolType) and bool(value)


def _evaluate(expression: _Expression, activation: Mapping[str, Any], errors: list[str]) -> Any:
    """The value, or None (with the reason appended to ``errors``) when it cannot be evaluated."""
    try:
        return expression.program.evaluate(dict(activation))
    except CELEvalError as err:  # cel-python raises the error value an expression ends in
        errors.append(f"{expression.where}: {err.args[0] if err.args else err}")
        return None


def load_documents(path: Path = NODE_SCOPE_POLICY) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def load_policy(path: Path = NODE_SCOPE_POLICY) -> AdmissionPolicy:
    policies = [d for d in load_documents(path) if d["kind"] == "ValidatingAdmissionPolicy"]
    assert len(policies) == 1, f"expected one ValidatingAdmissionPolicy in {path}"
    return AdmissionPolicy(policies[0])


def agent_extra(node: str, pod: str = "vcuda-agent-x7k2p") -> dict[str, list[str]]:
    """The extra of the agent pod's bound token, as the API server's authenticator sets it."""
    return {
        "authentication.kubernetes.io/credential-id": ["JTI=7d2b6a4e-5c1f-4e0b-9a8d-2f1e3c4b5a69"],
        NODE_NAME_EXTRA: [node],
        "authentication.kubernetes.io/node-uid": ["6a1f9c2d-7e33-4a88-b2c4-6f9d0e1a3b57"],
        "authentication.kubernetes.io/pod-name": [pod],
        "authentication.kubernetes.io/pod-uid": ["0b5e3c6a-1d2f-4e5a-9b8c-7d6e5f4a3b2c"],
    }


def admission_request(
    obj: Doc | None,
    old: Doc | None,
    *,
    username: str = AGENT_USER,
    extra: Mapping[str, list[str]] | None = None,
    groups: Sequence[str] = (
        "system:serviceaccounts",
        "system:serviceaccounts:kube-system",
        "system:authenticated",
    ),
    subresource: str = "",
    operation: str = "UPDATE",
) -> Doc:
    """The AdmissionRequest of a PATCH (UPDATE) as the policy's ``request`` sees it."""
    target = obj if obj is not None else old
    assert target is not None
    kind = target["kind"]
    meta = target["metadata"]
    gvk = {"group": "", "version": "v1", "kind": kind}
    gvr = {"group": "", "version": "v1", "resource": _RESOURCES[kind]}
    user: Doc = {"username": username, "uid": "5a1f9c2d-7e33-4a88-b2c4-6f9d0e1a3b57", "groups": list(groups)}
    if extra:
        user["extra"] = {k: list(v) for k, v in extra.items()}
    request: Doc = {
        "uid": "3e2b1c4d-5f6a-4b7c-8d9e-0f1a2b3c4d5e",
        "kind": gvk,
        "resource": gvr,
        "requestKind": gvk,
        "requestResource": gvr,
        "name": meta["name"],
        "operation": operation,
        "userInfo": user,
        "dryRun": False,
        "options": {"apiVersion": "meta.k8s.io/v1", "kind": "PatchOptions"},
    }
    if subresource:
        request["subResource"] = request["requestSubResource"] = subresource
    if meta.get("namespace"):
        request["namespace"] = meta["namespace"]
    return request
