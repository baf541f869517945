#pragma once
// The two pictures of the training report, as SVG documents.
#include <string>

#include "report/run_history.h"

namespace moe {

// Training loss per step (raw and a moving average), validation loss points, the unigram
// entropy baseline dashed; axes with ticks and labels, and a legend.
std::string loss_chart_svg(const RunHistory& h);

// Share of routed tokens per expert: rows are MoE layers, columns experts, one panel for the
// whole run and one for the last window, on a common colour scale. Needs per-expert counts
// (a dense model or old metrics get a short note instead of a grid).
std::string expert_load_svg(const RunHistory& h);

}  // namespace moe
