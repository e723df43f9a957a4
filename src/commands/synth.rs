//! `sparda synth`: write a random-weight checkpoint.

use crate::*;
use sparda::Result;

pub(crate) fn cmd_synth(a: SynthArgs) -> Result<()> {
    let preset = sparda::synth::Preset::from_name(&a.preset)?;
    sparda::synth::write(preset, a.seed, &a.out, &a.tokenizer)?;
    eprintln!(
        "wrote {} ({} preset, seed {})",
        a.out.display(),
        a.preset,
        a.seed
    );
    if a.forecast {
        let path = a.out.join("forecast.safetensors");
        let tensors =
            sparda::model::forecast::ForecastWeights::synth_tensors(&preset.config(), a.seed);
        sparda::weights::write_safetensors(&path, &tensors)?;
        eprintln!("wrote {} (random forecast weights)", path.display());
    }
    Ok(())
}
