// Validate Prometheus Operator objects (ServiceMonitor, PodMonitor,
// PrometheusRule) against the schemas of their CRDs, as compiled by the npm
// package @kubernetes-models/prometheus-operator (installed by
// scripts/bootstrap.sh). Reads a JSON array of objects on stdin; prints one
// JSON line {"index", "kind", "ok", "errors"} per object.
//
//   node validate_crds.mjs <node_modules dir> < objects.json
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
import path from "node:path";

const modules = process.argv[2];
const load = async (kind) =>
  (await import(pathToFileURL(path.join(modules, "@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1", kind + ".js")).href))[kind];

const objects = JSON.parse(readFileSync(0, "utf8"));
for (const [index, obj] of objects.entries()) {
  let ok = false, errors = null;
  try {
    const Model = await load(obj.kind);
    new Model(obj).validate();
    ok = true;
  } catch (e) {
    errors = String(e && e.message ? e.message : e);
  }
  console.log(JSON.stringify({ index, kind: obj.kind, ok, errors }));
}
