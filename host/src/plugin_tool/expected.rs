//! A case's `expect`: the parts of a result it names must match; the rest is free.

use serde_json::Value;

/// `Ok` when `actual` has everything `expect` names: an object's listed keys (recursively),
/// an array's every element (same length), numbers within 1e-4 (relative), anything else
/// equal. The error names the first path that differs.
pub fn check(expect: &Value, actual: &Value, path: &str) -> Result<(), String> {
    match (expect, actual) {
        (Value::Object(e), Value::Object(a)) => e.iter().try_for_each(|(k, v)| {
            let at = format!("{path}.{k}");
            a.get(k)
                .ok_or_else(|| format!("{at} is missing"))
                .and_then(|got| check(v, got, &at))
        }),
        (Value::Array(e), Value::Array(a)) if e.len() == a.len() => e
            .iter()
            .zip(a)
            .enumerate()
            .try_for_each(|(i, (e, a))| check(e, a, &format!("{path}[{i}]"))),
        (Value::Array(e), Value::Array(a)) => Err(format!(
            "{path} has {} elements, expected {}",
            a.len(),
            e.len()
        )),
        (Value::Number(e), Value::Number(a)) => {
            let (e, a) = (
                e.as_f64().unwrap_or(f64::NAN),
                a.as_f64().unwrap_or(f64::NAN),
            );
            match (e - a).abs() <= 1e-4 * e.abs().max(1.0) {
                true => Ok(()),
                false => Err(format!("{path} is {a}, expected {e}")),
            }
        }
        (e, a) if e == a => Ok(()),
        (e, a) => Err(format!("{path} is {a}, expected {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn named_parts_must_match_and_the_rest_is_free() {
        let actual = json!({"results": [{"id": "b", "score": 1.50001}], "extra": true});
        assert!(check(
            &json!({"results": [{"id": "b", "score": 1.5}]}),
            &actual,
            "r"
        )
        .is_ok());
        let err = check(&json!({"results": [{"id": "a"}]}), &actual, "r").unwrap_err();
        assert!(err.contains("r.results[0].id"), "{err}");
        let err = check(&json!({"results": []}), &actual, "r").unwrap_err();
        assert!(err.contains("1 elements, expected 0"), "{err}");
        assert!(check(&json!({"missing": 1}), &actual, "r").is_err());
    }
}
