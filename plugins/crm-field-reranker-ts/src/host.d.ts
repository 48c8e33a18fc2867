// The `host` interface every plugin imports (wit/plugins.wit).
declare module "gateway:plugins/host@0.1.0" {
  export type LogLevel = "trace" | "debug" | "info" | "warn" | "error";
  /** Writes to the gateway's log, tagged with the tenant and plugin name. */
  export function log(level: LogLevel, message: string): void;
  /** A configuration value the platform admin set for this tenant, if any. */
  export function configGet(key: string): string | undefined;
}
