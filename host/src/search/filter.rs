//! Metadata filters, in the operator syntax Pinecone and Chroma users already write:
//! `{"team": "billing"}`, `{"price": {"$gte": 10, "$lt": 20}}`, `{"tags": {"$in": ["a", "b"]}}`,
//! `{"$or": [{...}, {...}]}`. Several keys in one object must all hold. On a string-array field
//! `$eq` means "contains", `$in` "shares any", `$ne`/`$nin` their negations.

use serde_json::{Map, Value};

#[derive(Debug, Clone, PartialEq)]
pub enum Filter {
    And(Vec<Filter>),
    Or(Vec<Filter>),
    Not(Box<Filter>),
    Cmp {
        field: String,
        op: Op,
        value: Scalar,
    },
    In {
        field: String,
        values: Vec<Scalar>,
        negate: bool,
    },
    Exists {
        field: String,
        exists: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Op {
    Eq,
    Ne,
    Gt,
    Gte,
    Lt,
    Lte,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Scalar {
    Str(String),
    Num(f64),
    Bool(bool),
}

impl Scalar {
    fn parse(v: &Value, at: &str) -> Result<Self, String> {
        match v {
            Value::String(s) => Ok(Self::Str(s.clone())),
            Value::Number(n) => Ok(Self::Num(n.as_f64().unwrap_or(f64::NAN))),
            Value::Bool(b) => Ok(Self::Bool(*b)),
            other => Err(format!(
                "`{at}` compares with a string, number or boolean, not {other}"
            )),
        }
    }

    fn matches(&self, v: &Value) -> bool {
        match (self, v) {
            (Self::Str(a), Value::String(b)) => a == b,
            (Self::Num(a), Value::Number(b)) => b.as_f64() == Some(*a),
            (Self::Bool(a), Value::Bool(b)) => a == b,
            _ => false,
        }
    }

    fn order(&self, v: &Value) -> Option<std::cmp::Ordering> {
        match (v, self) {
            (Value::Number(b), Self::Num(a)) => b.as_f64()?.partial_cmp(a),
            (Value::String(b), Self::Str(a)) => Some(b.as_str().cmp(a)),
            _ => None,
        }
    }
}

impl Filter {
    /// Parses a filter object; errors name the offending key so the caller can fix it.
    /// True for filters that match every document by their shape alone (`{}`, `{"$and": []}`),
    /// which a delete must not take as a mistake-free "delete all".
    pub fn matches_everything(&self) -> bool {
        match self {
            Filter::And(items) => items.iter().all(Filter::matches_everything),
            Filter::Or(items) => items.iter().any(Filter::matches_everything),
            _ => false,
        }
    }

    pub fn parse(v: &Value) -> Result<Self, String> {
        let Value::Object(m) = v else {
            return Err(format!("a filter is a JSON object, not {v}"));
        };
        let mut all = Vec::with_capacity(m.len());
        for (key, value) in m {
            all.push(match key.as_str() {
                "$and" | "$or" => {
                    let Value::Array(items) = value else {
                        return Err(format!("`{key}` takes an array of filters"));
                    };
                    let items = items.iter().map(Self::parse).collect::<Result<_, _>>()?;
                    if key == "$and" {
                        Self::And(items)
                    } else {
                        Self::Or(items)
                    }
                }
                "$not" => Self::Not(Box::new(Self::parse(value)?)),
                k if k.starts_with('$') => {
                    return Err(format!(
                        "unknown filter operator `{k}` (use $and, $or, $not at the top level)"
                    ))
                }
                field => Self::field(field, value)?,
            });
        }
        Ok(if all.len() == 1 {
            all.pop().unwrap_or(Self::And(Vec::new()))
        } else {
            Self::And(all)
        })
    }

    fn field(field: &str, v: &Value) -> Result<Self, String> {
        let Value::Object(ops) = v else {
            return Ok(Self::Cmp {
                field: field.into(),
                op: Op::Eq,
                value: Scalar::parse(v, field)?,
            });
        };
        let mut all = Vec::with_capacity(ops.len());
        for (op, arg) in ops {
            let at = format!("{field}.{op}");
            let cmp = |op| -> Result<Self, String> {
                Ok(Self::Cmp {
                    field: field.into(),
                    op,
                    value: Scalar::parse(arg, &at)?,
                })
            };
            all.push(match op.as_str() {
                "$eq" => cmp(Op::Eq)?,
                "$ne" => cmp(Op::Ne)?,
                "$gt" => cmp(Op::Gt)?,
                "$gte" => cmp(Op::Gte)?,
                "$lt" => cmp(Op::Lt)?,
                "$lte" => cmp(Op::Lte)?,
                "$in" | "$nin" => {
                    let Value::Array(items) = arg else {
                        return Err(format!("`{at}` takes an array"));
                    };
                    Self::In {
                        field: field.into(),
                        values: items
                            .iter()
                            .map(|i| Scalar::parse(i, &at))
                            .collect::<Result<_, _>>()?,
                        negate: op == "$nin",
                    }
                }
                "$exists" => Self::Exists {
                    field: field.into(),
                    exists: arg
                        .as_bool()
                        .ok_or_else(|| format!("`{at}` takes true or false"))?,
                },
                other => {
                    return Err(format!(
                        "unknown operator `{other}` on `{field}` (use $eq, $ne, $gt, $gte, $lt, $lte, $in, $nin, $exists)"
                    ))
                }
            });
        }
        Ok(if all.len() == 1 {
            all.pop().unwrap_or(Self::And(Vec::new()))
        } else {
            Self::And(all)
        })
    }

    /// Whether a document's metadata passes. A missing field fails every comparison except
    /// `$ne`, `$nin` and `$exists: false`.
    pub fn matches(&self, meta: &Map<String, Value>) -> bool {
        match self {
            Self::And(fs) => fs.iter().all(|f| f.matches(meta)),
            Self::Or(fs) => fs.iter().any(|f| f.matches(meta)),
            Self::Not(f) => !f.matches(meta),
            Self::Exists { field, exists } => meta.contains_key(field) == *exists,
            Self::In {
                field,
                values,
                negate,
            } => {
                let hit = meta
                    .get(field)
                    .is_some_and(|v| values.iter().any(|s| contains(v, s)));
                hit != *negate
            }
            Self::Cmp { field, op, value } => {
                let Some(v) = meta.get(field) else {
                    return *op == Op::Ne;
                };
                use std::cmp::Ordering::*;
                match op {
                    Op::Eq => contains(v, value),
                    Op::Ne => !contains(v, value),
                    Op::Gt => value.order(v) == Some(Greater),
                    Op::Gte => matches!(value.order(v), Some(Greater | Equal)),
                    Op::Lt => value.order(v) == Some(Less),
                    Op::Lte => matches!(value.order(v), Some(Less | Equal)),
                }
            }
        }
    }
}

/// Equality, where an array field holds the value if any element equals it.
fn contains(v: &Value, s: &Scalar) -> bool {
    match v {
        Value::Array(items) => items.iter().any(|i| s.matches(i)),
        v => s.matches(v),
    }
}

/// Checks that metadata holds only filterable values: strings, numbers, booleans and arrays of
/// strings (nested objects would be silently unfilterable, so they are refused up front).
pub fn check_metadata(meta: &Map<String, Value>) -> Result<(), String> {
    for (k, v) in meta {
        let ok = match v {
            Value::String(_) | Value::Number(_) | Value::Bool(_) => true,
            Value::Array(items) => items.iter().all(Value::is_string),
            _ => false,
        };
        if !ok {
            return Err(format!(
                "metadata field `{k}` must be a string, number, boolean or array of strings"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check(filter: Value, meta: Value) -> bool {
        let Value::Object(m) = meta else { panic!() };
        Filter::parse(&filter).unwrap().matches(&m)
    }

    #[test]
    fn operators() {
        let doc = json!({"team": "billing", "price": 12, "tags": ["vip", "eu"], "open": true});
        assert!(check(json!({"team": "billing"}), doc.clone()));
        assert!(!check(json!({"team": "sales"}), doc.clone()));
        assert!(check(
            json!({"price": {"$gte": 12, "$lt": 20}}),
            doc.clone()
        ));
        assert!(!check(json!({"price": {"$gt": 12}}), doc.clone()));
        assert!(check(json!({"tags": "vip"}), doc.clone()));
        assert!(check(json!({"tags": {"$in": ["x", "eu"]}}), doc.clone()));
        assert!(!check(json!({"tags": {"$nin": ["eu"]}}), doc.clone()));
        assert!(check(
            json!({"open": true, "team": {"$ne": "x"}}),
            doc.clone()
        ));
        assert!(check(
            json!({"$or": [{"team": "x"}, {"price": {"$lte": 12}}]}),
            doc.clone()
        ));
        assert!(check(json!({"$not": {"team": "x"}}), doc.clone()));
        assert!(check(json!({"missing": {"$ne": 1}}), doc.clone()));
        assert!(!check(json!({"missing": {"$lt": 1}}), doc.clone()));
        assert!(check(json!({"missing": {"$exists": false}}), doc.clone()));
        assert!(check(json!({"team": {"$gt": "a"}}), doc));
    }

    #[test]
    fn errors_name_the_problem() {
        let e = Filter::parse(&json!({"price": {"$between": [1, 2]}})).unwrap_err();
        assert!(e.contains("$between") && e.contains("price"), "{e}");
        let e = Filter::parse(&json!({"$or": {"a": 1}})).unwrap_err();
        assert!(e.contains("$or"), "{e}");
        let e = Filter::parse(&json!({"a": {"$in": 3}})).unwrap_err();
        assert!(e.contains("a.$in"), "{e}");
        assert!(check_metadata(json!({"x": {"y": 1}}).as_object().unwrap()).is_err());
        assert!(check_metadata(json!({"x": [1]}).as_object().unwrap()).is_err());
        assert!(check_metadata(json!({"x": ["a"], "n": 1.5}).as_object().unwrap()).is_ok());
    }
}
