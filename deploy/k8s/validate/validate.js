#!/usr/bin/env node
// Offline validation of Kubernetes manifests (`deploy/k8s/make_job.py JOB.yaml | node validate.js -`).
//
//   node validate.js [--no-strict] [--crd CRD.yaml]... FILE...   validate every object ("-": stdin)
//   node validate.js --to-json FILE...       print the objects as one JSON array (no validation)
//
// Each document (YAML, several per file, or JSON; `kind: List` is expanded) is checked against the
// schema of its apiVersion and kind from kubernetes-models (the API's OpenAPI schema, compiled):
// types, enums, required fields. Custom resources are checked against the openAPIV3Schema of their
// CustomResourceDefinition: JobSet's, vendored in third_party/jobset, is always loaded, and --crd
// adds others (see crdValidator). An unknown apiVersion/kind fails. The schemas ignore fields they
// do not know, so a strict pass follows (see unknownFields) and a few checks the API server would
// make and no schema states (see semanticErrors). Prints "ok KIND/NAME" or "FAIL KIND/NAME: why"
// per object; exits 0 when all are ok, 1 when any failed, 2 on bad usage or unreadable input.
"use strict";

const fs = require("fs");
const path = require("path");
const YAML = require("yaml");

// apiVersion "batch/v1" -> kubernetes-models/batch/v1; "v1" (core) -> kubernetes-models/v1.
function modelFor(apiVersion, kind) {
  if (typeof apiVersion !== "string" || typeof kind !== "string" ||
      !/^([a-z0-9][a-z0-9.-]*\/)?v[0-9][a-z0-9]*$/.test(apiVersion)) {
    return null;
  }
  let group;
  try {
    group = require(path.join("kubernetes-models", apiVersion));
  } catch (e) {
    return null;  // no such API group/version
  }
  // Only a top-level resource: its class carries apiVersion and kind (JobSpec, say, does not).
  const model = Object.prototype.hasOwnProperty.call(group, kind) ? group[kind] : null;
  return model && model.kind === kind && model.apiVersion === apiVersion ? model : null;
}

// The schema's errors for `obj` ([] when valid), as ajv reports them: {instancePath, message}.
function schemaErrors(model, obj) {
  try {
    new model(obj).validate();
    return [];
  } catch (e) {
    if (Array.isArray(e.errors)) return e.errors;
    // A validator that trips over a value it does not expect (only the strict probe makes those).
    return [{ instancePath: "", message: String(e.message || e) }];
  }
}

// A value no schema accepts, except one that accepts anything ({} or preserve-unknown-fields).
const PROBE = Symbol("probe");

function escapePointer(key) {
  return String(key).replace(/~/g, "~0").replace(/\//g, "~1");
}

// The paths (JSON pointers) of fields that the schema does not know. kubernetes-models' schemas
// allow additional properties everywhere, so the schema cannot say so directly; instead each field
// in turn is replaced by PROBE: a field the schema knows (a named property, or a key of a map such
// as labels) is then reported at its own path, an unknown one is not, and its subtree is skipped.
// Fields typed "any value" would be reported as unknown; the core APIs Rubato uses have none.
function unknownFields(model, obj) {
  const unknown = [];
  const visit = (parent, pointer) => {
    const keys = Array.isArray(parent) ? parent.map((_, i) => i) : Object.keys(parent);
    for (const key of keys) {
      const here = pointer + "/" + escapePointer(key);
      const saved = parent[key];
      parent[key] = PROBE;
      const errors = schemaErrors(model, obj);
      parent[key] = saved;
      const known = errors.some(
        (e) => e.instancePath === here || e.instancePath.startsWith(here + "/"));
      if (!known) {
        unknown.push(here);
      } else if (saved !== null && typeof saved === "object") {
        visit(saved, here);
      }
    }
  };
  visit(obj, "");
  return unknown;
}

// The vendored CRDs (third_party/, beside this file's real path: ../../../third_party).
const VENDORED_CRDS = [
  path.join(__dirname, "..", "..", "..", "third_party", "jobset", "jobset.x-k8s.io_jobsets.yaml"),
];
const crds = new Map();  // "group/version Kind" -> ajv validate function

// A CRD's schema made strict as the API server's field validation is (kubectl apply's default,
// Strict, refuses unknown fields): every object schema that lists properties and neither allows
// additional ones nor preserves unknown fields gets additionalProperties: false. The schema's CEL
// rules (x-kubernetes-validations) and formats are not checked.
function strictSchema(schema) {
  if (Array.isArray(schema)) return schema.map(strictSchema);
  if (schema === null || typeof schema !== "object") return schema;
  const out = {};
  for (const [k, v] of Object.entries(schema)) {
    out[k] = k === "properties"
      ? Object.fromEntries(Object.entries(v).map(([p, s]) => [p, strictSchema(s)]))
      : strictSchema(v);
  }
  if (out.properties && out.additionalProperties === undefined &&
      !out["x-kubernetes-preserve-unknown-fields"]) {
    out.additionalProperties = false;
  }
  return out;
}

function loadCrds(file) {
  const Ajv = require("ajv");
  for (const crd of readDocuments(file)) {
    if (!crd || crd.kind !== "CustomResourceDefinition" || !crd.spec) {
      throw new Error(`${file}: not a CustomResourceDefinition`);
    }
    for (const version of crd.spec.versions || []) {
      if (!version.served || !version.schema) continue;
      const ajv = new Ajv({ strict: false, allErrors: true, validateFormats: false });
      const schema = strictSchema(version.schema.openAPIV3Schema);
      crds.set(`${crd.spec.group}/${version.name} ${crd.spec.names.kind}`, ajv.compile(schema));
    }
  }
}

function crdErrors(validateFn, obj) {
  if (validateFn(obj)) return [];
  return validateFn.errors.map((e) => {
    const extra = e.params && e.params.additionalProperty;
    return extra ? `${e.instancePath}/${extra}: unknown field`
      : `${e.instancePath || "/"} ${e.message}`;
  });
}

const DNS1123_LABEL = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?$/;
const DNS1123_SUBDOMAIN = /^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$/;
const DNS1035_LABEL = /^[a-z]([-a-z0-9]*[a-z0-9])?$/;

// What the API server refuses although the schema allows it (only what these manifests could get
// wrong: names, a Job's restart policy, a container without an image, an Indexed Job's count).
function semanticErrors(obj) {
  const errors = [];
  const name = obj.metadata && obj.metadata.name;
  if (typeof name !== "string" || name === "") {
    errors.push("metadata.name is missing");
  } else if (obj.kind === "Service" ? !DNS1035_LABEL.test(name) || name.length > 63
    : !DNS1123_SUBDOMAIN.test(name) || name.length > 253) {
    errors.push(`metadata.name "${name}" is not a valid ${obj.kind} name`);
  }
  if (obj.kind === "JobSet" && obj.spec && Array.isArray(obj.spec.replicatedJobs)) {
    // Each replicated job makes Jobs <jobset>-<name>-<index>: check them as the API server will.
    for (const rjob of obj.spec.replicatedJobs) {
      const jobName = `${name}-${rjob.name}-0`;
      const child = { kind: "Job", metadata: { name: jobName }, spec: rjob.template.spec };
      const subdomain = (obj.spec.network && obj.spec.network.subdomain) || name;
      child.spec = { ...child.spec, template: { ...child.spec.template,
        spec: { ...child.spec.template.spec, subdomain } } };
      for (const e of semanticErrors(child)) errors.push(`replicated job ${rjob.name}: ${e}`);
    }
  }
  const template = obj.spec && obj.spec.template && obj.spec.template.spec;
  if (obj.kind === "Job" && template) {
    if (obj.spec.podFailurePolicy && template.restartPolicy !== "Never") {
      errors.push("a podFailurePolicy needs the pods' restartPolicy Never");
    }
    if (obj.spec.backoffLimitPerIndex !== undefined && obj.spec.completionMode !== "Indexed") {
      errors.push("backoffLimitPerIndex needs completionMode Indexed");
    }
    if (!["Never", "OnFailure"].includes(template.restartPolicy)) {
      errors.push("a Job's pods need restartPolicy Never or OnFailure, got " +
        template.restartPolicy);
    }
    if (obj.spec.completionMode === "Indexed" && !(obj.spec.completions >= 1)) {
      errors.push("an Indexed Job needs completions >= 1");
    }
    // An Indexed Job's pod i is named <job>-<i> (a DNS label when it has a subdomain).
    if (template.subdomain !== undefined && (!DNS1123_LABEL.test(template.subdomain) ||
        !DNS1123_LABEL.test(`${name}-0`))) {
      errors.push(`subdomain "${template.subdomain}" or the pods' host names are not DNS labels`);
    }
  }
  const pod = obj.kind === "Pod" ? obj.spec : template;
  if (pod) {
    for (const c of [...(pod.initContainers || []), ...(pod.containers || [])]) {
      if (!c.image) errors.push(`container ${c.name} has no image`);
    }
  }
  return errors;
}

function readDocuments(file) {
  const text = fs.readFileSync(file === "-" ? 0 : file, "utf8");
  const docs = YAML.parseAllDocuments(text, { version: "1.1" });  // as Kubernetes reads YAML
  const objects = [];
  for (const doc of docs) {
    if (doc.errors.length) throw new Error(`${file}: ${doc.errors[0].message}`);
    const value = doc.toJS();
    if (value === null || value === undefined) continue;  // an empty document
    if (value && value.kind === "List" && Array.isArray(value.items)) objects.push(...value.items);
    else objects.push(value);
  }
  return objects;
}

function describe(obj) {
  const kind = obj && typeof obj === "object" && obj.kind ? obj.kind : "?";
  const name = obj && obj.metadata && obj.metadata.name ? obj.metadata.name : "?";
  return `${kind}/${name}`;
}

// The failures of one object ([] when it is valid).
function check(obj, strict) {
  if (obj === null || typeof obj !== "object" || Array.isArray(obj)) return ["not an object"];
  const custom = crds.get(`${obj.apiVersion} ${obj.kind}`);
  if (custom) {
    const errors = crdErrors(custom, obj);
    return errors.length ? errors : semanticErrors(obj);
  }
  const model = modelFor(obj.apiVersion, obj.kind);
  if (!model) return [`unknown kind ${obj.kind} in ${obj.apiVersion}`];
  obj = JSON.parse(JSON.stringify(obj));
  // Secret data is base64, which kustomize wraps at 76 characters; the API server's decoder skips
  // the line breaks, the schema's "byte" format does not.
  if (obj.kind === "Secret" && obj.data && typeof obj.data === "object") {
    for (const k of Object.keys(obj.data)) {
      if (typeof obj.data[k] === "string") obj.data[k] = obj.data[k].replace(/[\r\n]/g, "");
    }
  }
  const errors = schemaErrors(model, obj);
  if (errors.length) {
    return errors.map((e) => `${e.instancePath || "/"} ${e.message}`);
  }
  const failures = semanticErrors(obj);
  if (strict) {
    for (const field of unknownFields(model, obj)) {
      failures.push(`${field}: unknown field`);
    }
  }
  return failures;
}

function main(argv) {
  let strict = true;
  let toJson = false;
  const files = [];
  const crdFiles = [...VENDORED_CRDS];
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg === "--no-strict") strict = false;
    else if (arg === "--crd" && i + 1 < argv.length) crdFiles.push(argv[++i]);
    else if (arg === "--to-json") toJson = true;
    else if (arg.startsWith("--")) {
      process.stderr.write(`validate.js: unknown flag ${arg}\n`);
      return 2;
    } else files.push(arg);
  }
  if (!files.length) {
    process.stderr.write(
      "usage: node validate.js [--no-strict | --to-json] [--crd CRD.yaml]... FILE... (-: stdin)\n");
    return 2;
  }
  let objects = [];
  try {
    if (!toJson) for (const f of crdFiles) loadCrds(f);
    for (const f of files) objects = objects.concat(readDocuments(f));
  } catch (e) {
    process.stderr.write(`validate.js: ${e.message}\n`);
    return 2;
  }
  if (toJson) {
    process.stdout.write(JSON.stringify(objects) + "\n");
    return 0;
  }
  if (!objects.length) {
    process.stderr.write("validate.js: no objects in the input\n");
    return 1;
  }
  let failed = 0;
  for (const obj of objects) {
    const failures = check(obj, strict);
    if (failures.length) {
      failed++;
      process.stdout.write(`FAIL ${describe(obj)}: ${failures.join("; ")}\n`);
    } else {
      process.stdout.write(`ok ${describe(obj)}\n`);
    }
  }
  process.stdout.write(`${objects.length - failed} ok, ${failed} failed\n`);
  return failed ? 1 : 0;
}

if (require.main === module) process.exitCode = main(process.argv.slice(2));

module.exports = { check, unknownFields, modelFor };
