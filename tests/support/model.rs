//! Where the tests find the default model: `GATEWAY_TEST_MODEL`, else the file that
//! `host/scripts/fetch-models.sh` puts in `models/`.

pub fn model_path() -> String {
    std::env::var("GATEWAY_TEST_MODEL").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../models/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
        .into()
    })
}
