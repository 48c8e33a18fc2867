// The imports of gateway:plugins@0.2.0 (the WIT in wit/), as componentize-js presents them:
// kebab-case names in camelCase, `option` as `undefined`, lists of numbers as arrays, a
// variant as `{tag, val}` with the case's WIT name as `tag`.

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

declare module "gateway:plugins/vocabulary@0.2.0" {
  /** The text of a token (special tokens as their name). */
  export function tokenText(id: number): string;
  /** Every token whose text starts with `prefix`. */
  export function tokensWithPrefix(prefix: string, ignoreCase: boolean): Uint32Array | number[];
  /** Every token whose text contains `text`. */
  export function tokensContaining(text: string, ignoreCase: boolean): Uint32Array | number[];
}

/** A record `{code, message}`; thrown as an exception's `payload`, it is the call's `err`. */
type PluginError = { code: string; message: string };
