// Validates Prometheus Operator objects against @kubernetes-models/prometheus-operator
// (JSON schemas generated from the operator's API types; the version is pinned in
// package.json and package-lock.json beside this file).
//
//   node check.mjs NODE_MODULES OBJECTS.json
//
// OBJECTS.json: a JSON list of objects. Prints one JSON line: a list of
// {kind, name, errors} with every schema error, plus every field the schema does not
// know ("unknown field spec.endpoints[0].prot"): the generated validators accept unknown
// fields, so each object is wrapped in a Proxy that records which fields validation read,
// and a field it never read is one the schema does not define (kubectl --strict's rule).
// Maps the schema declares (labels, matchLabels, ...) are enumerated by the validator and
// so count as read.
import { readFileSync } from "node:fs";
import path from "node:path";
import { pathToFileURL } from "node:url";

const [modules, objectsFile] = process.argv.slice(2);
const objects = JSON.parse(readFileSync(objectsFile, "utf8"));

const KINDS = {
  "monitoring.coreos.com/v1": ["PodMonitor", "ServiceMonitor", "PrometheusRule", "Probe"],
};

async function model(apiVersion, kind) {
  if (!(KINDS[apiVersion] || []).includes(kind)) return null;
  const group = apiVersion.split("/")[0];
  const version = apiVersion.split("/")[1];
  const file = path.join(modules, "@kubernetes-models/prometheus-operator", group, version, `${kind}.js`);
  return (await import(pathToFileURL(file).href))[kind];
}

// A deep copy of `value` whose objects record the keys read (get/has) and whether their
// keys were listed (ownKeys: the validator walks a map).
function tracked(value, where, registry) {
  if (value === null || typeof value !== "object") return value;
  const copy = Array.isArray(value)
    ? value.map((v, i) => tracked(v, `${where}[${i}]`, registry))
    : Object.fromEntries(Object.entries(value).map(([k, v]) => [k, tracked(v, where ? `${where}.${k}` : k, registry)]));
  if (Array.isArray(copy)) return copy;
  const entry = { where, keys: Object.keys(copy), read: new Set(), listed: false };
  registry.push(entry);
  return new Proxy(copy, {
    get(target, key, receiver) {
      if (typeof key === "string") entry.read.add(key);
      return Reflect.get(target, key, receiver);
    },
    has(target, key) {
      if (typeof key === "string") entry.read.add(key);
      return Reflect.has(target, key);
    },
    ownKeys(target) {
      entry.listed = true;
      return Reflect.ownKeys(target);
    },
  });
}

const results = [];
for (const obj of objects) {
  const kind = obj.kind;
  const name = (obj.metadata || {}).name;
  const Model = await model(obj.apiVersion, kind);
  if (Model === null) {
    results.push({ kind, name, errors: [`no model for ${obj.apiVersion} ${kind}`] });
    continue;
  }
  const errors = [];
  try {
    new Model(obj).validate();
  } catch (err) {
    errors.push(String(err.message || err));
  }
  // The model's own validator, called on the tracked copy, tells which fields it reads.
  const registry = [];
  const copy = tracked(obj, "", registry);
  const validate = (await import(pathToFileURL(path.join(
    modules, "@kubernetes-models/prometheus-operator/_schemas",
    `ComGithubPrometheusOperatorPrometheusOperatorPkgApisMonitoringV1${kind}.js`)).href)).validate;
  validate(copy);
  for (const entry of registry) {
    if (entry.listed) continue;
    for (const key of entry.keys) {
      if (!entry.read.has(key)) errors.push(`unknown field ${entry.where ? `${entry.where}.` : ""}${key}`);
    }
  }
  results.push({ kind, name, errors });
}
console.log(JSON.stringify(results));
