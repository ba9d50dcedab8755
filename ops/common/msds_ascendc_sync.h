// Ascend C helpers shared by the op_kernel sources (device code only).
//
// Scalar reads/writes of UB (GetValue / SetValue) are not ordered against the
// vector (V) and copy (MTE2 in, MTE3 out) pipes; these barriers make one pipe
// wait for another, e.g. Sync<HardEvent::MTE2_S>() before reading ids that a
// DataCopy just brought in.
#ifndef MSDS_ASCENDC_SYNC_H
#define MSDS_ASCENDC_SYNC_H

#include "kernel_operator.h"

namespace msds {

template <AscendC::HardEvent kEvent>
__aicore__ inline void Sync() {
  event_t id = static_cast<event_t>(GetTPipePtr()->FetchEventID(kEvent));
  AscendC::SetFlag<kEvent>(id);
  AscendC::WaitFlag<kEvent>(id);
}

}  // namespace msds

#endif  // MSDS_ASCENDC_SYNC_H
