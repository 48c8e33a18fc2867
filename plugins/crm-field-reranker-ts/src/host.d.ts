// The `host` interface every plugin imports (wit/plugins.wit, gateway:plugins@0.2.0), as
// componentize-js presents it: a variant as `{tag, val}` with the case's WIT name as `tag`.

/** A metadata or configuration value, with the type the document or policy gave it. */
type Value =
  | { tag: "text"; val: string }
  | { tag: "number"; val: number }
  | { tag: "boolean"; val: boolean }
  | { tag: "text-list"; val: string[] };

declare module "gateway:plugins/host@0.2.0" {
  export type LogLevel = "trace" | "debug" | "info" | "warn" | "error";
  /** Writes to the gateway's log, tagged with the tenant and plugin name. */
  export function log(level: LogLevel, message: string): void;
  /** A configuration value the platform admin set for this tenant, if any. */
  export function configGet(key: string): Value | undefined;
}
